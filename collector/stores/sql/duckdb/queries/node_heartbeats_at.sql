-- Each node of an instance (the instance itself, rank 0, and the ranks above it, which report as
-- <instance>/rank<r>) as its latest heartbeat at or before t_ns says: its KV bytes per token (its
-- layers' or heads' share), its cache's bytes and byte limit, and the memory it can still give. The
-- cache verdict names the node whose memory binds a capacity miss with it (issue 46).
SELECT h.instance_id, h.t_ns, h.kv_bytes_per_token, h.cache_bytes, h.cache_max_bytes, h.memory_free_bytes
FROM heartbeats h
JOIN (SELECT instance_id, max(t_ns) AS latest_ns FROM heartbeats
      WHERE (instance_id = $instance_id OR starts_with(instance_id, $instance_id || '/rank')) AND t_ns <= $t_ns
      GROUP BY instance_id) latest
  ON latest.instance_id = h.instance_id AND latest.latest_ns = h.t_ns
ORDER BY h.instance_id
