-- Per instance and source, the deepest block of a prompt (its chained hashes, in order) that an
-- earlier lookup or stored entry had before a moment, and the first row that had it. prefix_blocks
-- is ordered by hash (one granule range per hash), so ClickHouse reads every row of those hashes;
-- DuckDB reads only the rows that first had them (its prefix_reach.sql).
SELECT instance_id, source, block_index, t_ns, request_id, fingerprint
FROM (
    SELECT instance_id, source, block_index, t_ns, request_id, fingerprint,
           row_number() OVER (PARTITION BY instance_id, source
                              ORDER BY block_index DESC, t_ns, ifNull(request_id, '')) AS place
    FROM prefix_blocks
    WHERE hash IN {hashes:Array(Int64)}
      AND t_ns < {before_ns:Nullable(Int64)}
      AND arrayElement({hashes:Array(Int64)}, toUInt64(block_index + 1)) = hash
)
WHERE place = 1
ORDER BY block_index DESC, instance_id, source
