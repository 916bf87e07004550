-- Each node of an instance as its latest heartbeat at or before t_ns says (duckdb/queries/node_heartbeats_at.sql).
SELECT h.instance_id, h.t_ns, h.kv_bytes_per_token, h.cache_bytes, h.cache_max_bytes, h.memory_free_bytes
FROM heartbeats AS h
JOIN (SELECT instance_id, max(t_ns) AS latest_ns FROM heartbeats
      WHERE (instance_id = {instance_id:Nullable(String)}
             OR startsWith(instance_id, concat({instance_id:Nullable(String)}, '/rank'))) AND t_ns <= {t_ns:Nullable(Int64)}
      GROUP BY instance_id) AS latest
  ON latest.instance_id = h.instance_id AND latest.latest_ns = h.t_ns
ORDER BY h.instance_id
