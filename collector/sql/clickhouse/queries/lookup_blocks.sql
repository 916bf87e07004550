-- The chained block hashes of one request's prompt, in order.
SELECT block_index, hash
FROM prefix_blocks
WHERE request_id = {request_id:Nullable(String)} AND source = 'lookup'
ORDER BY block_index
