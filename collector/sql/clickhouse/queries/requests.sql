-- Requests that started in [since_ns, until_ns) on one instance or all, newest last.
SELECT *
FROM (
    SELECT *
    FROM requests
    WHERE ({since_ns:Nullable(Int64)} IS NULL OR start_ns >= {since_ns:Nullable(Int64)})
      AND ({until_ns:Nullable(Int64)} IS NULL OR start_ns < {until_ns:Nullable(Int64)})
      AND ({instance_id:Nullable(String)} IS NULL OR instance_id = {instance_id:Nullable(String)})
    ORDER BY start_ns DESC
    LIMIT {limit:UInt64}
)
ORDER BY start_ns
