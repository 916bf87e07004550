-- The prompt block hashes of every lookup in [since_ns, until_ns) (NULL: unbounded), by request then
-- block: the traffic whatif replays and export mooncake writes.
SELECT request_id, block_index, hash
FROM prefix_blocks
WHERE source = 'lookup'
  AND ({since_ns:Nullable(Int64)} IS NULL OR t_ns >= {since_ns:Nullable(Int64)})
  AND ({until_ns:Nullable(Int64)} IS NULL OR t_ns < {until_ns:Nullable(Int64)})
ORDER BY request_id, block_index, t_ns
