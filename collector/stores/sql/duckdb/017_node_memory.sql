-- The memory an instance's node can still give it (tokentrace.memory.free), per heartbeat: the
-- instances page's "how many GB are left, how many sessions fit" per node (issue 46).
ALTER TABLE heartbeats ADD COLUMN memory_free_bytes BIGINT;
