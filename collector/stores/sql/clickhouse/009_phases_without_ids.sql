-- The phases table without the trace, span and parent span ids of its spans, as in the DuckDB
-- dialect (012_phases_without_ids.sql): the `spans` table holds them, no query reads them here.
ALTER TABLE phases DROP COLUMN IF EXISTS trace_id;
ALTER TABLE phases DROP COLUMN IF EXISTS span_id;
ALTER TABLE phases DROP COLUMN IF EXISTS parent_span_id;
