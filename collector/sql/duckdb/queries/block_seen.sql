-- Who had this chained block hash before a moment (any instance, prompt or entry), latest first.
-- An equal hash at index k is an equal prefix of k+1 blocks; the ART index makes this a point lookup.
SELECT request_id, instance_id, source, t_ns
FROM prefix_blocks
WHERE hash = $hash
  AND t_ns < $before_ns
  AND request_id IS DISTINCT FROM $request_id
ORDER BY t_ns DESC
LIMIT 1
