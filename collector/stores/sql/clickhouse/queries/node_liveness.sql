-- Each node's last heartbeat and last step end in [t0_ns, t1_ns] (duckdb/queries/node_liveness.sql).
SELECT instance_id, max(heartbeat_ns) AS last_heartbeat_ns, max(step_end_ns) AS last_step_end_ns
FROM (
    SELECT instance_id, toNullable(t_ns) AS heartbeat_ns, CAST(NULL AS Nullable(Int64)) AS step_end_ns
    FROM heartbeats
    WHERE (instance_id = {instance_id:Nullable(String)}
           OR startsWith(instance_id, concat({instance_id:Nullable(String)}, '/rank')))
      AND t_ns >= {t0_ns:Nullable(Int64)} AND t_ns <= {t1_ns:Nullable(Int64)}
    UNION ALL
    SELECT instance_id, CAST(NULL AS Nullable(Int64)), toNullable(start_ns + coalesce(duration_ns, 0))
    FROM steps
    WHERE (instance_id = {instance_id:Nullable(String)}
           OR startsWith(instance_id, concat({instance_id:Nullable(String)}, '/rank')))
      AND start_ns >= {t0_ns:Nullable(Int64)} AND start_ns + coalesce(duration_ns, 0) <= {t1_ns:Nullable(Int64)}
)
GROUP BY instance_id
ORDER BY instance_id
