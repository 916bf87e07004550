-- What each instance's engine did in [since_ns, until_ns) (NULL: unbounded), in 10-second buckets
-- of step start: its steps' count and time, and over the steps it timed (a distributed engine's
-- ranks, one step in 8) their time, compute and waits on the ring. The instances page splits each
-- node's time into compute, ring, the rest of a step, and idle over time with it (issue 46).
SELECT instance_id, CAST(start_ns // 10000000000 * 10000000000 AS BIGINT) AS bucket_ns,
       count(*) AS steps, CAST(sum(duration_ns) AS BIGINT) AS step_sum_ns,
       count(compute_ns) AS timed_steps,
       CAST(sum(CASE WHEN compute_ns IS NOT NULL THEN duration_ns END) AS BIGINT) AS timed_sum_ns,
       CAST(sum(compute_ns) AS BIGINT) AS compute_sum_ns, CAST(sum(ring_wait_ns) AS BIGINT) AS ring_wait_sum_ns
FROM steps
WHERE ($since_ns::BIGINT IS NULL OR start_ns >= $since_ns)
  AND ($until_ns::BIGINT IS NULL OR start_ns < $until_ns)
  AND ($instance_id::VARCHAR IS NULL OR instance_id = $instance_id OR starts_with(instance_id, $instance_id || '/rank'))
GROUP BY instance_id, bucket_ns
ORDER BY instance_id, bucket_ns
