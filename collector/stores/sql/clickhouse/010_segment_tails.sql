-- Each segment's tail hash (its last block of tokens; null under two blocks), as in the DuckDB
-- dialect (015_segment_tails.sql); a bloom filter like `hash`'s.
ALTER TABLE segments ADD COLUMN IF NOT EXISTS tail_hash Nullable(Int64);
ALTER TABLE segments ADD INDEX IF NOT EXISTS tail_hash_bf tail_hash TYPE bloom_filter GRANULARITY 1;
