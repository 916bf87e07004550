-- Chained hashes at given block indexes of a stored entry (the insert of request_id at inserted_ns).
SELECT block_index, hash
FROM prefix_blocks
WHERE request_id = $request_id AND source = 'insert' AND t_ns = $inserted_ns
  AND block_index = ANY($block_indices::BIGINT[])
ORDER BY block_index
