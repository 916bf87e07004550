-- What one cache entry of an instance holds, from its heartbeat nearest t_ns (at or before, else the
-- first after), where one entry is a block of tokens (cache unit 'block', vLLM's KV blocks): its
-- byte limit / its entry limit / KV bytes per token. The engine reuses whole blocks of that many tokens.
SELECT intDiv(intDiv(cache_max_bytes, cache_max_entries), kv_bytes_per_token) AS block_tokens, t_ns
FROM heartbeats
WHERE instance_id = {instance_id:Nullable(String)} AND cache_unit = 'block' AND cache_max_entries > 0
  AND kv_bytes_per_token > 0 AND cache_max_bytes > 0
ORDER BY t_ns > {t_ns:Nullable(Int64)}, abs(t_ns - {t_ns:Nullable(Int64)}), t_ns
LIMIT 1
