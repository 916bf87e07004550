-- The first row of each (hash, instance, source) among the staged blocks: the writer appends those
-- it has not recorded lately (store_duckdb.RecentKeys) to prefix_sightings (003_prefix_sightings.sql).
-- This is the reference statement: the writer computes the same rows in numpy
-- (store_duckdb.first_sightings, 5-10 times cheaper), and tests/test_store_duckdb.py compares the two.
SELECT hash, arg_min(block_index, t_ns) AS block_index, min(t_ns) AS t_ns,
       arg_min(request_id, t_ns) AS request_id, instance_id, source,
       arg_min(fingerprint, t_ns) AS fingerprint
FROM (
    SELECT request_id, instance_id, t_ns, source, fingerprint,
           generate_subscripts(hashes, 1) - 1 AS block_index, unnest(hashes) AS hash
    FROM staged
)
GROUP BY hash, instance_id, source
