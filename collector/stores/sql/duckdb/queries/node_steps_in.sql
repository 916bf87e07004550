-- The steps of an instance's nodes (the instance itself, rank 0, and its ranks above 0, which report
-- as <instance>/rank<r>; NULL: every instance's) that started in [since_ns, until_ns) (NULL:
-- unbounded), newest first, at most `limit`, with the compute and ring waits of the ones a rank
-- timed: the timeline's node rows when an instance is opened into its nodes (issue 46).
SELECT instance_id, start_ns, duration_ns, compute_ns, ring_wait_ns
FROM steps
WHERE ($since_ns::BIGINT IS NULL OR start_ns >= $since_ns)
  AND ($until_ns::BIGINT IS NULL OR start_ns < $until_ns)
  AND ($instance_id::VARCHAR IS NULL OR instance_id = $instance_id OR starts_with(instance_id, $instance_id || '/rank'))
ORDER BY start_ns DESC, instance_id
LIMIT $limit
