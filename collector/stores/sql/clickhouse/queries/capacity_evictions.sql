-- Evictions for the given reasons (the capacity ones) on one instance before a moment, of entries of
-- at least min_tokens, latest first, with the insert that stored each entry (to check what it held).
-- join_use_nulls (store_clickhouse.py) gives the NULL inserted_ns DuckDB gives.
SELECT e.t_ns AS t_ns, e.fingerprint AS fingerprint, e.tokens AS tokens, e.reason AS reason,
       e.entry_request_id AS entry_request_id, e.evicted_by_request_id AS evicted_by_request_id,
       e.cache_entries AS cache_entries, e.cache_bytes AS cache_bytes, i.start_ns AS inserted_ns
FROM cache_evictions AS e
LEFT JOIN cache_inserts AS i ON i.fingerprint = e.fingerprint AND i.request_id = e.entry_request_id
WHERE isNotDistinctFrom(e.instance_id, {instance_id:Nullable(String)})
  AND e.t_ns < {before_ns:Nullable(Int64)}
  AND e.tokens >= {min_tokens:Nullable(Int64)}
  AND e.reason IN {reasons:Array(String)}
ORDER BY e.t_ns DESC
LIMIT 8
