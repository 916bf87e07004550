-- Twin of sql/duckdb/005_span_fidelity.sql: trace state, scope version and the sender's dropped
-- counts of each span (NULL when none). Idempotent, like every ClickHouse migration.
ALTER TABLE spans ADD COLUMN IF NOT EXISTS trace_state Nullable(String);
ALTER TABLE spans ADD COLUMN IF NOT EXISTS scope_version LowCardinality(Nullable(String));
ALTER TABLE spans ADD COLUMN IF NOT EXISTS dropped_attributes_count Nullable(Int64);
ALTER TABLE spans ADD COLUMN IF NOT EXISTS dropped_events_count Nullable(Int64);
ALTER TABLE spans ADD COLUMN IF NOT EXISTS dropped_links_count Nullable(Int64);
