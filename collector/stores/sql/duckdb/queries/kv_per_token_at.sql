-- The KV bytes per token an instance declared in its latest heartbeat at or before t_ns (or, failing
-- that, its first one after: the first heartbeat follows the model load).
SELECT kv_bytes_per_token, t_ns
FROM heartbeats
WHERE instance_id = $instance_id AND kv_bytes_per_token > 0
ORDER BY t_ns > $t_ns, abs(t_ns - $t_ns), t_ns
LIMIT 1
