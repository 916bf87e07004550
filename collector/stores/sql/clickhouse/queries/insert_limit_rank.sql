-- The rank an instance's byte limit counted, as the insert that evicted an entry declared it
-- (duckdb/queries/insert_limit_rank.sql).
SELECT limit_rank
FROM cache_inserts
WHERE request_id = {request_id:Nullable(String)}
  AND isNotDistinctFrom(instance_id, {instance_id:Nullable(String)})
  AND start_ns <= {evicted_ns:Nullable(Int64)} AND end_ns >= {evicted_ns:Nullable(Int64)}
ORDER BY start_ns DESC, limit_rank ASC NULLS LAST
LIMIT 1
