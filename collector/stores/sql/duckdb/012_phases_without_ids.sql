-- The phases table without the trace, span and parent span ids of its spans (issue 17). The
-- `spans` table holds each of them already (a phase is its span's request_id, name and start_ns
-- there), no verdict or view reads them here, and random hex ids do not compress: they were 35 of
-- the table's 52 bytes a span and 40 % of what appending its rows cost (1.1 us of merge CPU an
-- engine span, measured; docs/benchmarks.md, Issue 17, twelfth round). Dropping a column rewrites
-- no rows: the table's other columns are kept as they are.
ALTER TABLE phases DROP COLUMN trace_id;
ALTER TABLE phases DROP COLUMN span_id;
ALTER TABLE phases DROP COLUMN parent_span_id;
