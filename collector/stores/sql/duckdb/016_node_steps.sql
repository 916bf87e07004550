-- A distributed engine's rank, per engine step it timed: its own compute and its time waiting on
-- the ring (null where the step was not timed, and for one process). The slowness verdict splits a
-- request's prefill and decode steps into compute and communication per node with them (issue 46).
ALTER TABLE steps ADD COLUMN compute_ns BIGINT;
ALTER TABLE steps ADD COLUMN ring_wait_ns BIGINT;
