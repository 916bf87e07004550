-- A distributed instance's nodes (the instance itself, rank 0, and its ranks above 0, which report
-- as <instance>/rank<r>) in [t0_ns, t1_ns]: each one's last heartbeat (its process alive: the
-- control plane) and the end of its last engine step (its progress: the data plane), for a request
-- that failed because the ring stopped moving (issue 46). A step counts once it ended: the one
-- the stall held ended after the failure.
SELECT instance_id, max(heartbeat_ns) AS last_heartbeat_ns, max(step_end_ns) AS last_step_end_ns
FROM (
    SELECT instance_id, t_ns AS heartbeat_ns, CAST(NULL AS BIGINT) AS step_end_ns
    FROM heartbeats
    WHERE (instance_id = $instance_id OR starts_with(instance_id, $instance_id || '/rank'))
      AND t_ns >= $t0_ns AND t_ns <= $t1_ns
    UNION ALL
    SELECT instance_id, CAST(NULL AS BIGINT), start_ns + coalesce(duration_ns, 0)
    FROM steps
    WHERE (instance_id = $instance_id OR starts_with(instance_id, $instance_id || '/rank'))
      AND start_ns >= $t0_ns AND start_ns + coalesce(duration_ns, 0) <= $t1_ns
)
GROUP BY instance_id
ORDER BY instance_id
