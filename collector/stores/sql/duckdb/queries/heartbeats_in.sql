-- Heartbeats in [since_ns, until_ns) (NULL: unbounded), by instance then time.
SELECT instance_id, t_ns, queue_depth, running, max_batch, cache_entries, cache_bytes, cache_max_entries,
       cache_max_bytes, kv_bytes_per_token, memory_bytes, cache_unit
FROM heartbeats
WHERE ($since_ns::BIGINT IS NULL OR t_ns >= $since_ns)
  AND ($until_ns::BIGINT IS NULL OR t_ns < $until_ns)
ORDER BY instance_id, t_ns
