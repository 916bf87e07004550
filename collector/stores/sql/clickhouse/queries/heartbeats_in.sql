-- Heartbeats in [since_ns, until_ns) (NULL: unbounded), by instance then time.
SELECT instance_id, t_ns, queue_depth, running, max_batch, cache_entries, cache_bytes, cache_max_entries,
       cache_max_bytes, kv_bytes_per_token, memory_bytes, cache_unit
FROM heartbeats
WHERE ({since_ns:Nullable(Int64)} IS NULL OR t_ns >= {since_ns:Nullable(Int64)})
  AND ({until_ns:Nullable(Int64)} IS NULL OR t_ns < {until_ns:Nullable(Int64)})
ORDER BY instance_id, t_ns
