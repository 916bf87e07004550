-- Evictions for the given reasons (the capacity ones) on one instance before a moment, of entries of
-- at least min_tokens, latest first, with the insert that stored each entry (to check what it held).
SELECT e.t_ns, e.fingerprint, e.tokens, e.reason, e.entry_request_id, e.evicted_by_request_id,
       e.cache_entries, e.cache_bytes, i.start_ns AS inserted_ns
FROM cache_evictions e
LEFT JOIN cache_inserts i ON i.fingerprint = e.fingerprint AND i.request_id = e.entry_request_id
WHERE e.instance_id IS NOT DISTINCT FROM $instance_id
  AND e.t_ns < $before_ns
  AND e.tokens >= $min_tokens
  AND e.reason = ANY($reasons::VARCHAR[])
ORDER BY e.t_ns DESC
LIMIT 8
