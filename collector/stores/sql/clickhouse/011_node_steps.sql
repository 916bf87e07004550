-- A distributed engine's rank's compute and ring wait per timed step, as in the DuckDB dialect
-- (016_node_steps.sql).
ALTER TABLE steps ADD COLUMN IF NOT EXISTS compute_ns Nullable(Int64);
ALTER TABLE steps ADD COLUMN IF NOT EXISTS ring_wait_ns Nullable(Int64);
