-- The prompt block hashes of several requests whose lookups happened in [t0_ns, t1_ns].
SELECT request_id, block_index, hash
FROM (
    SELECT request_id, generate_subscripts(hashes, 1) - 1 AS block_index, unnest(hashes) AS hash
    FROM prefix_block_lists
    WHERE request_id = ANY($request_ids::VARCHAR[]) AND source = 'lookup' AND t_ns BETWEEN $t0_ns AND $t1_ns
)
ORDER BY request_id, block_index
