-- Earlier requests' segments whose tail hash equals one of the given ones (duckdb/queries/tail_matches.sql).
SELECT request_id, instance_id, t_ns, segment_index, role, token_start, token_end, hash, tail_hash
FROM segments
WHERE tail_hash IN {tails:Array(Int64)}
  AND t_ns < {before_ns:Nullable(Int64)}
  AND (request_id IS NULL OR request_id <> {request_id:Nullable(String)})
ORDER BY t_ns DESC
LIMIT 200
