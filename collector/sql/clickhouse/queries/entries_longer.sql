-- Cache entries inserted before a moment (any instance) holding one of the given chained hashes
-- (the caller passes only the blocks past what was reused): one row per entry, deepest block.
-- Aliased in a subquery: in ClickHouse an output alias t_ns would shadow the column in WHERE.
SELECT request_id, instance_id, fingerprint, last_block, first_ns AS t_ns
FROM (
    SELECT request_id, instance_id, fingerprint, max(block_index) AS last_block, min(t_ns) AS first_ns
    FROM prefix_blocks
    WHERE hash IN {hashes:Array(Int64)}
      AND source = 'insert'
      AND t_ns < {before_ns:Nullable(Int64)}
    GROUP BY request_id, instance_id, fingerprint
)
ORDER BY last_block DESC, t_ns DESC
LIMIT 200
