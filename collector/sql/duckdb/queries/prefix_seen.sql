-- The deepest block of a prompt (its chained hashes) that any earlier prompt or cache entry had, on
-- any instance, and who had it first. An equal hash at index k is an equal prefix of k+1 blocks.
SELECT block_index AS last_block, request_id, instance_id, source, t_ns
FROM prefix_sightings
WHERE hash = ANY($hashes::BIGINT[])
  AND t_ns < $before_ns
ORDER BY block_index DESC, t_ns, request_id
LIMIT 1
