-- The deepest block of a prompt (its chained hashes) that any earlier prompt or cache entry had, on
-- any instance, and who had it first. prefix_blocks is ordered by hash: each hash is one granule
-- range, so ClickHouse needs no first-sighting table (DuckDB's prefix_sightings gives equal rows).
SELECT block_index AS last_block, request_id, instance_id, source, t_ns
FROM prefix_blocks
WHERE hash IN {hashes:Array(Int64)}
  AND t_ns < {before_ns:Nullable(Int64)}
ORDER BY block_index DESC, t_ns, request_id
LIMIT 1
