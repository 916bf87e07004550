-- The latest heartbeat of every instance that sent one.
SELECT h.instance_id, h.t_ns, h.queue_depth, h.running, h.max_batch, h.cache_entries, h.cache_bytes,
       h.cache_max_entries, h.cache_max_bytes, h.kv_bytes_per_token, h.memory_bytes, h.cache_unit,
       h.memory_free_bytes
FROM heartbeats AS h
JOIN (SELECT instance_id, max(t_ns) AS t_ns FROM heartbeats GROUP BY instance_id) AS latest
  ON latest.instance_id = h.instance_id AND latest.t_ns = h.t_ns
ORDER BY h.instance_id
