-- Requests that started in [since_ns, until_ns) on one instance or all, newest last: one row per
-- request, the observers' views merged (fragments/request_rows.sql). A request a gateway saw starts
-- at the gateway's arrival, up to 10 minutes (the gateway's default request timeout) before the
-- engine's row: rows that far beyond the window are read to find them.
WITH inside AS (
    SELECT *
    FROM requests
    WHERE observer IS DISTINCT FROM 'gateway'
      AND ($since_ns::BIGINT IS NULL OR start_ns >= $since_ns)
      AND ($until_ns::BIGINT IS NULL OR start_ns < $until_ns + 600000000000)
      AND ($instance_id::VARCHAR IS NULL OR instance_id = $instance_id)
), outside AS (
    SELECT *
    FROM requests
    WHERE observer = 'gateway'
      AND ($since_ns::BIGINT IS NULL OR start_ns >= $since_ns - 600000000000)
      AND ($until_ns::BIGINT IS NULL OR start_ns < $until_ns)
      AND ($instance_id::VARCHAR IS NULL OR instance_id = $instance_id
           OR request_id IN (SELECT request_id FROM inside))
),
-- include: request_rows
SELECT *
FROM (
    SELECT *
    FROM request_rows
    WHERE ($since_ns::BIGINT IS NULL OR start_ns >= $since_ns)
      AND ($until_ns::BIGINT IS NULL OR start_ns < $until_ns)
      AND ($instance_id::VARCHAR IS NULL OR instance_id = $instance_id)
    ORDER BY start_ns DESC
    LIMIT $limit
)
ORDER BY start_ns
