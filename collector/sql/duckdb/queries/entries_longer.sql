-- Cache entries inserted before a moment (any instance) holding one of the given chained hashes
-- (the caller passes only the blocks past what was reused): one row per entry, deepest block.
SELECT request_id, instance_id, fingerprint, max(block_index) AS last_block, min(t_ns) AS t_ns
FROM prefix_blocks
WHERE hash = ANY($hashes::BIGINT[])
  AND source = 'insert'
  AND t_ns < $before_ns
GROUP BY request_id, instance_id, fingerprint
ORDER BY last_block DESC, t_ns DESC
LIMIT 200
