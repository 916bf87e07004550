-- The first appearance before a moment of each of a prompt's chained block hashes, per instance and
-- source. prefix_blocks is ordered by hash (one granule range per hash), so ClickHouse reads every
-- row of those hashes and keeps the first, as DuckDB's prefix_sightings does at write time.
-- Aggregates are aliased apart in a subquery: an alias equal to a column name would shadow it.
SELECT hash, instance_id, source, first_block AS block_index, first_ns AS t_ns, first_request AS request_id,
       first_fingerprint AS fingerprint
FROM (
    SELECT hash, instance_id, source,
           argMin(block_index, (t_ns, request_id)) AS first_block, min(t_ns) AS first_ns,
           argMin(request_id, (t_ns, request_id)) AS first_request,
           argMin(fingerprint, (t_ns, request_id)) AS first_fingerprint
    FROM prefix_blocks
    WHERE hash IN {hashes:Array(Int64)}
      AND t_ns < {before_ns:Nullable(Int64)}
    GROUP BY hash, instance_id, source
)
ORDER BY block_index, instance_id, source
