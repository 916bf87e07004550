-- The rank whose bytes a distributed engine's prompt-cache byte limit counted, per insert, as in the
-- DuckDB dialect (021_insert_limit_rank.sql). Rows stored before stay NULL (undeclared: the verdict
-- takes rank 0's). Filling them from `spans` needs a mutation with a helper table to join through
-- (joinGet), and a mutation runs in the background after its ALTER returns, on a shared server beside
-- other collectors' opens re-running this file: dropping the helper under it leaves it failing for
-- good, so a collector's open does not start one.
ALTER TABLE cache_inserts ADD COLUMN IF NOT EXISTS limit_rank Nullable(Int64);
