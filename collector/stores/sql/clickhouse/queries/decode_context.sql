-- Engine steps of one instance in [t0_ns, t1_ns] in which a request was decoding.
SELECT start_ns, duration_ns, prefill_seqs, decode_seqs, prefill_tokens, decode_tokens,
       prefill_request_ids, decode_request_ids
FROM steps
WHERE instance_id = {instance_id:Nullable(String)}
  AND start_ns >= {t0_ns:Nullable(Int64)}
  AND start_ns <= {t1_ns:Nullable(Int64)}
  AND has(decode_request_ids, {request_id:Nullable(String)})
ORDER BY start_ns
