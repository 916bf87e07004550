-- Cache entries inserted before a moment (any instance) that hold at least min_block + 1 blocks of a
-- prompt: one row per entry with its deepest shared block.
SELECT request_id, instance_id, fingerprint, max(block_index) AS last_block, min(t_ns) AS t_ns
FROM prefix_blocks
WHERE source = 'insert'
  AND hash IN (SELECT unnest($hashes::BIGINT[]))
  AND block_index >= $min_block
  AND t_ns < $before_ns
GROUP BY request_id, instance_id, fingerprint
ORDER BY last_block DESC, t_ns DESC
LIMIT 200
