-- The prompt block hashes of every lookup in [since_ns, until_ns) (NULL: unbounded), by request then
-- block: the traffic whatif replays and export mooncake writes.
SELECT request_id, block_index, hash
FROM (
    SELECT request_id, t_ns, generate_subscripts(hashes, 1) - 1 AS block_index, unnest(hashes) AS hash
    FROM prefix_block_lists
    WHERE source = 'lookup'
      AND ($since_ns::BIGINT IS NULL OR t_ns >= $since_ns)
      AND ($until_ns::BIGINT IS NULL OR t_ns < $until_ns)
)
ORDER BY request_id, block_index, t_ns
