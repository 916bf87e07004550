-- A distributed instance's last stall report in [t0_ns, t1_ns]: the heartbeat of its rank 0 (the
-- instance itself) whose tokentrace.stall.* said its ring had not moved (issue 46), with its
-- attributes. A request failed by the stall reads it (analyzers/slowness.py): when the ring stopped
-- (its t_ns less tokentrace.stall.ms) and the ranks rank 0's diagnosis named
-- (tokentrace.stall.ranks), both known before the step the stall held is stored.
SELECT start_ns AS t_ns, attributes
FROM spans
WHERE name = 'instance.heartbeat' AND instance_id = $instance_id
  AND start_ns >= $t0_ns AND start_ns <= $t1_ns
  AND contains(attributes, '"tokentrace.stall.state"')
ORDER BY start_ns DESC
LIMIT 1
