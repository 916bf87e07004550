-- Requests that started in [since_ns, until_ns) on one instance or all, newest last: one row per
-- request, the observers' views merged (fragments/request_rows.sql). A request a gateway saw starts
-- at the gateway's arrival, up to 10 minutes (the gateway's default request timeout) before the
-- engine's row: rows that far beyond the window are read to find them.
WITH inside AS (
    SELECT *
    FROM requests
    WHERE (observer IS NULL OR observer != 'gateway')
      AND ({since_ns:Nullable(Int64)} IS NULL OR start_ns >= {since_ns:Nullable(Int64)})
      AND ({until_ns:Nullable(Int64)} IS NULL OR start_ns < {until_ns:Nullable(Int64)} + 600000000000)
      AND ({instance_id:Nullable(String)} IS NULL OR instance_id = {instance_id:Nullable(String)})
), outside AS (
    SELECT *
    FROM requests
    WHERE observer = 'gateway'
      AND ({since_ns:Nullable(Int64)} IS NULL OR start_ns >= {since_ns:Nullable(Int64)} - 600000000000)
      AND ({until_ns:Nullable(Int64)} IS NULL OR start_ns < {until_ns:Nullable(Int64)})
      AND ({instance_id:Nullable(String)} IS NULL OR instance_id = {instance_id:Nullable(String)}
           OR request_id IN (SELECT request_id FROM inside))
),
-- include: request_rows
SELECT *
FROM (
    SELECT *
    FROM request_rows
    WHERE ({since_ns:Nullable(Int64)} IS NULL OR start_ns >= {since_ns:Nullable(Int64)})
      AND ({until_ns:Nullable(Int64)} IS NULL OR start_ns < {until_ns:Nullable(Int64)})
      AND ({instance_id:Nullable(String)} IS NULL OR instance_id = {instance_id:Nullable(String)})
    ORDER BY start_ns DESC
    LIMIT {limit:UInt64}
)
ORDER BY start_ns
