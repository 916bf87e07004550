-- The longest prefix of a prompt (given as chained block hashes) that any earlier prompt or cache
-- entry had, on any instance. Chained hashes make an equal hash at index k an equal prefix of k+1
-- blocks, so the deepest equal hash is the answer.
SELECT block_index AS last_block, request_id, instance_id, source, t_ns
FROM prefix_blocks
WHERE hash IN {hashes:Array(Int64)}
  AND t_ns < {before_ns:Nullable(Int64)}
  AND (request_id IS NULL OR request_id <> {request_id:Nullable(String)})
ORDER BY block_index DESC, t_ns DESC
LIMIT 1
