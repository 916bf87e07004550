-- What one of cache_entries (and cache_max_entries) counts: 'entry' (an MLX prompt-cache entry),
-- 'block' (a vLLM KV block), 'slot' (a llama.cpp slot) or 'token' (contract attribute
-- tokentrace.cache.unit). Rows written before this column existed stay NULL: unknown, not 'entry'.
ALTER TABLE heartbeats ADD COLUMN IF NOT EXISTS cache_unit LowCardinality(Nullable(String));
ALTER TABLE cache_lookups ADD COLUMN IF NOT EXISTS cache_unit LowCardinality(Nullable(String));

-- What the upstream engine reported about the request in its own fields, as the gateway's adapter
-- read them (tokentrace.upstream.evidence: llama.cpp timings and its re-processing reason, Ollama's
-- load and keep-alive expiry, Exo's runner stage): a JSON object the verdicts cite as evidence.
ALTER TABLE requests ADD COLUMN IF NOT EXISTS upstream_evidence Nullable(String);
