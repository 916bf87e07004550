-- What one of cache_entries (and cache_max_entries) counts: 'entry' (an MLX prompt-cache entry),
-- 'block' (a vLLM KV block), 'slot' (a llama.cpp slot) or 'token' (contract attribute
-- tokentrace.cache.unit). Rows written before this column existed stay NULL: unknown, not 'entry'.
ALTER TABLE heartbeats ADD COLUMN IF NOT EXISTS cache_unit LowCardinality(Nullable(String));
ALTER TABLE cache_lookups ADD COLUMN IF NOT EXISTS cache_unit LowCardinality(Nullable(String));
