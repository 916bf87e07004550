-- The memory an instance's node can still give it, per heartbeat, as in the DuckDB dialect
-- (017_node_memory.sql).
ALTER TABLE heartbeats ADD COLUMN IF NOT EXISTS memory_free_bytes Nullable(Int64);
