-- The prompt block hashes of several requests whose lookups happened in [t0_ns, t1_ns].
SELECT request_id, block_index, hash
FROM prefix_blocks
WHERE request_id IN {request_ids:Array(String)} AND source = 'lookup'
  AND t_ns BETWEEN {t0_ns:Nullable(Int64)} AND {t1_ns:Nullable(Int64)}
ORDER BY request_id, block_index
