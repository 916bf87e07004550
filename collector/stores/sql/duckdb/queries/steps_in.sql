-- Engine steps that started in [since_ns, until_ns) (NULL: unbounded) on one instance or all.
SELECT instance_id, start_ns, duration_ns, prefill_seqs, decode_seqs, prefill_tokens, decode_tokens,
       prefill_request_ids, decode_request_ids
FROM steps
WHERE ($since_ns::BIGINT IS NULL OR start_ns >= $since_ns)
  AND ($until_ns::BIGINT IS NULL OR start_ns < $until_ns)
  AND ($instance_id::VARCHAR IS NULL OR instance_id = $instance_id)
ORDER BY instance_id, start_ns
