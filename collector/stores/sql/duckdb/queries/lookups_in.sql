-- Cache lookups in [since_ns, until_ns) (NULL: unbounded) on every instance, oldest first: what
-- whatif replays (tokens reused, block size).
SELECT request_id, instance_id, start_ns, prompt_tokens, matched_tokens, block_size
FROM cache_lookups
WHERE ($since_ns::BIGINT IS NULL OR start_ns >= $since_ns)
  AND ($until_ns::BIGINT IS NULL OR start_ns < $until_ns)
ORDER BY start_ns, request_id
