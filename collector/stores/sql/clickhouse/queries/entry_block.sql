-- Chained hashes at given block indexes of a stored entry (the insert of request_id at inserted_ns).
SELECT block_index, hash
FROM prefix_blocks
WHERE request_id = {request_id:Nullable(String)} AND source = 'insert' AND t_ns = {inserted_ns:Nullable(Int64)}
  AND block_index IN {block_indices:Array(Int64)}
ORDER BY block_index
