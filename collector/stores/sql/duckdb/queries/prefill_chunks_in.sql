-- Prefill chunks that started in [since_ns, until_ns) (NULL: unbounded), for the timeline and export.
SELECT request_id, instance_id, start_ns, end_ns, chunk_offset, tokens, batch_size
FROM prefill_chunks
WHERE ($since_ns::BIGINT IS NULL OR start_ns >= $since_ns)
  AND ($until_ns::BIGINT IS NULL OR start_ns < $until_ns)
-- request_id breaks ties: the chunks of one batched prefill step start at one instant.
ORDER BY start_ns, request_id
