-- What one of cache_entries (and cache_max_entries) counts: 'entry' (an MLX prompt-cache entry),
-- 'block' (a vLLM KV block), 'slot' (a llama.cpp slot) or 'token' (contract attribute
-- tokentrace.cache.unit). Rows written before this column existed stay NULL: unknown, not 'entry'.
ALTER TABLE heartbeats ADD COLUMN cache_unit VARCHAR;
ALTER TABLE cache_lookups ADD COLUMN cache_unit VARCHAR;
