-- Evictions of given cache entries (by fingerprint) before a moment.
SELECT instance_id, t_ns, fingerprint, tokens, bytes, reason, entry_request_id, evicted_by_request_id,
       cache_entries, cache_bytes
FROM cache_evictions
WHERE fingerprint = ANY($fingerprints::BIGINT[])
  AND t_ns < $before_ns
ORDER BY t_ns
