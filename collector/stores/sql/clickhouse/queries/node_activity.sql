-- What each instance's engine did per 10-second bucket (duckdb/queries/node_activity.sql).
SELECT instance_id, intDiv(start_ns, 10000000000) * 10000000000 AS bucket_ns,
       toInt64(count()) AS steps, sum(duration_ns) AS step_sum_ns,
       toInt64(count(compute_ns)) AS timed_steps,
       sumIf(duration_ns, compute_ns IS NOT NULL) AS timed_sum_ns,
       sum(compute_ns) AS compute_sum_ns, sum(ring_wait_ns) AS ring_wait_sum_ns
FROM steps
WHERE ({since_ns:Nullable(Int64)} IS NULL OR start_ns >= {since_ns:Nullable(Int64)})
  AND ({until_ns:Nullable(Int64)} IS NULL OR start_ns < {until_ns:Nullable(Int64)})
  AND ({instance_id:Nullable(String)} IS NULL OR instance_id = {instance_id:Nullable(String)}
       OR startsWith(instance_id, concat({instance_id:Nullable(String)}, '/rank')))
GROUP BY instance_id, bucket_ns
ORDER BY instance_id, bucket_ns
