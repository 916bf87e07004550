-- Requests that started in [since_ns, until_ns) on one instance or all, newest last.
SELECT *
FROM (
    SELECT *
    FROM requests
    WHERE ($since_ns::BIGINT IS NULL OR start_ns >= $since_ns)
      AND ($until_ns::BIGINT IS NULL OR start_ns < $until_ns)
      AND ($instance_id::VARCHAR IS NULL OR instance_id = $instance_id)
    ORDER BY start_ns DESC
    LIMIT $limit
)
ORDER BY start_ns
