-- Chained hashes at given block indexes of a stored entry (the insert of request_id at inserted_ns).
SELECT block_index, hash
FROM (
    SELECT generate_subscripts(hashes, 1) - 1 AS block_index, unnest(hashes) AS hash
    FROM prefix_block_lists
    WHERE request_id = $request_id AND source = 'insert' AND t_ns = $inserted_ns
)
WHERE block_index = ANY($block_indices::BIGINT[])
ORDER BY block_index
