-- The chained block hashes of one request's prompt, in order (one packed row per lookup).
SELECT block_index, hash
FROM (
    SELECT generate_subscripts(hashes, 1) - 1 AS block_index, unnest(hashes) AS hash
    FROM prefix_block_lists
    WHERE request_id = $request_id AND source = 'lookup' AND t_ns BETWEEN $t0_ns AND $t1_ns
)
ORDER BY block_index
