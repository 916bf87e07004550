-- Time to first *visible* token (issue 12): ms from arrival to the first response chunk that
-- carried answer text (tokentrace.request.first_content_ms); the DuckDB twin is 006 as well.
ALTER TABLE requests ADD COLUMN IF NOT EXISTS first_content_ms Nullable(Float64);
