-- The staged blocks that can be new where they appear (003_prefix_sightings.sql): past what the
-- request's lookup matched. An entry whose lookup is not in this batch has all its blocks here.
-- Earliest first: the writer keeps the first row of each (hash, instance, source) it has not
-- recorded lately (store_duckdb.RecentKeys) and appends those to prefix_sightings.
SELECT hash, block_index, t_ns, request_id, instance_id, source, fingerprint
FROM (
    SELECT s.request_id, s.instance_id, s.t_ns, s.source, s.fingerprint,
           coalesce(s.known, l.known, 0) AS known,
           generate_subscripts(s.hashes, 1) - 1 AS block_index, unnest(s.hashes) AS hash
    FROM staged s
    LEFT JOIN (SELECT request_id, max(known) AS known FROM staged WHERE source = 'lookup' GROUP BY request_id) l
           ON s.source = 'insert' AND l.request_id = s.request_id
)
WHERE block_index >= known
ORDER BY t_ns
