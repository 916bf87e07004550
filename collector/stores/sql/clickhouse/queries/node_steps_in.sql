-- The steps of an instance's nodes, newest first (duckdb/queries/node_steps_in.sql).
SELECT instance_id, start_ns, duration_ns, compute_ns, ring_wait_ns
FROM steps
WHERE ({since_ns:Nullable(Int64)} IS NULL OR start_ns >= {since_ns:Nullable(Int64)})
  AND ({until_ns:Nullable(Int64)} IS NULL OR start_ns < {until_ns:Nullable(Int64)})
  AND ({instance_id:Nullable(String)} IS NULL OR instance_id = {instance_id:Nullable(String)}
       OR startsWith(instance_id, concat({instance_id:Nullable(String)}, '/rank')))
ORDER BY start_ns DESC, instance_id
LIMIT {limit:UInt64}
