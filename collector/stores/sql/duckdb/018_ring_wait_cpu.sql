-- The CPU time a distributed engine's rank used while it waited on the ring in a step it timed
-- (tokentrace.steps.ring_wait_cpu): a wait with less CPU than its length was partly spent off the
-- CPU, a starved rank rather than a slow link (issue 46).
ALTER TABLE steps ADD COLUMN ring_wait_cpu_ns BIGINT;
