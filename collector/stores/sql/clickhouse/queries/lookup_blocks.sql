-- The chained block hashes of one request's prompt, in order.
SELECT block_index, hash
FROM prefix_blocks
WHERE request_id = {request_id:Nullable(String)} AND source = 'lookup'
  AND t_ns BETWEEN {t0_ns:Nullable(Int64)} AND {t1_ns:Nullable(Int64)}
ORDER BY block_index
