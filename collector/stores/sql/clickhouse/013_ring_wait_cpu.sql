-- The CPU time a rank used while it waited on the ring, as in the DuckDB dialect (018_ring_wait_cpu.sql).
ALTER TABLE steps ADD COLUMN IF NOT EXISTS ring_wait_cpu_ns Nullable(Int64);
