-- The rank whose bytes an instance's prompt-cache byte limit counted, as the insert that evicted an
-- entry declared it (cache_inserts.limit_rank, NULL where it declared none): request_id's insert on
-- the instance whose span holds the eviction (llm.cache.evict is an event of that span).
SELECT limit_rank
FROM cache_inserts
WHERE request_id = $request_id AND instance_id IS NOT DISTINCT FROM $instance_id
  AND start_ns <= $evicted_ns AND end_ns >= $evicted_ns
ORDER BY start_ns DESC, limit_rank NULLS LAST
LIMIT 1
