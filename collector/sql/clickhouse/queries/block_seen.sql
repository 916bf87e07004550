-- Who had this chained block hash before a moment (any instance, prompt or entry), latest first.
-- An equal hash at index k is an equal prefix of k+1 blocks; prefix_blocks is ordered by hash, so
-- this reads one granule range.
SELECT request_id, instance_id, source, t_ns
FROM prefix_blocks
WHERE hash = {hash:Nullable(Int64)}
  AND t_ns < {before_ns:Nullable(Int64)}
  AND (request_id IS NULL OR request_id <> {request_id:Nullable(String)})
ORDER BY t_ns DESC
LIMIT 1
