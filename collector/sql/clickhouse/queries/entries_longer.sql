-- Cache entries inserted before a moment (any instance) that hold at least min_block + 1 blocks of a
-- prompt: one row per entry with its deepest shared block. (Aliased in a subquery: in ClickHouse an
-- output alias t_ns would shadow the column t_ns in WHERE.)
SELECT request_id, instance_id, fingerprint, last_block, first_ns AS t_ns
FROM (
    SELECT request_id, instance_id, fingerprint, max(block_index) AS last_block, min(t_ns) AS first_ns
    FROM prefix_blocks
    WHERE source = 'insert'
      AND hash IN {hashes:Array(Int64)}
      AND block_index >= {min_block:Nullable(Int64)}
      AND t_ns < {before_ns:Nullable(Int64)}
    GROUP BY request_id, instance_id, fingerprint
)
ORDER BY last_block DESC, t_ns DESC
LIMIT 200
