-- The first appearance before a moment of each of a prompt's chained block hashes, per instance and
-- source ('lookup': a prompt had it; 'insert': a cache entry stored there held it). An equal hash at
-- index k is an equal prefix of k+1 blocks. A list parameter written name[] binds one parameter per
-- element (store_duckdb.bind_lists): DuckDB uses the ART index for an IN list of values only, and
-- only when nothing else filters the same scan: the time filter waits outside the MATERIALIZED CTE
-- (with it inside, a verdict's lookup took 180 ms at 53M rows instead of 7 ms).
WITH hits AS MATERIALIZED (
    SELECT hash, block_index, t_ns, request_id, instance_id, source, fingerprint
    FROM prefix_sightings
    WHERE hash IN ($hashes[])
)
SELECT hash, instance_id, source,
       arg_min(block_index, (t_ns, request_id)) AS block_index, min(t_ns) AS t_ns,
       arg_min(request_id, (t_ns, request_id)) AS request_id,
       arg_min(fingerprint, (t_ns, request_id)) AS fingerprint
FROM hits
WHERE t_ns < $before_ns
GROUP BY hash, instance_id, source
ORDER BY block_index, instance_id, source
