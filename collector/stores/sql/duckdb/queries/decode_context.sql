-- Engine steps of one instance in [t0_ns, t1_ns] in which a request was decoding.
SELECT start_ns, duration_ns, prefill_seqs, decode_seqs, prefill_tokens, decode_tokens,
       prefill_request_ids, decode_request_ids
FROM steps
WHERE instance_id = $instance_id
  AND start_ns >= $t0_ns
  AND start_ns <= $t1_ns
  AND list_contains(decode_request_ids, $request_id)
ORDER BY start_ns
