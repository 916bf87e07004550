-- Per instance, the deepest block of a prompt (its chained hashes) that a cache entry stored there
-- before a moment held, and the first entry that held it.
SELECT instance_id, last_block, request_id, fingerprint, first_ns AS t_ns
FROM (
    SELECT instance_id, block_index AS last_block, request_id, fingerprint, t_ns AS first_ns,
           row_number() OVER (PARTITION BY instance_id ORDER BY block_index DESC, t_ns, request_id) AS place
    FROM prefix_blocks
    WHERE hash IN {hashes:Array(Int64)}
      AND source = 'insert'
      AND t_ns < {before_ns:Nullable(Int64)}
)
WHERE place = 1
ORDER BY last_block DESC, instance_id
