-- Cache evictions in [since_ns, until_ns) (NULL: unbounded) on every instance, oldest first.
SELECT instance_id, t_ns, fingerprint, tokens, bytes, reason, entry_request_id, evicted_by_request_id,
       cache_entries, cache_bytes
FROM cache_evictions
WHERE ({since_ns:Nullable(Int64)} IS NULL OR t_ns >= {since_ns:Nullable(Int64)})
  AND ({until_ns:Nullable(Int64)} IS NULL OR t_ns < {until_ns:Nullable(Int64)})
ORDER BY t_ns
