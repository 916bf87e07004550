-- Earlier requests' segments whose content hash equals one of the given hashes.
SELECT request_id, instance_id, t_ns, segment_index, role, token_start, token_end, hash
FROM segments
WHERE hash IN {hashes:Array(Int64)}
  AND t_ns < {before_ns:Nullable(Int64)}
  AND (request_id IS NULL OR request_id <> {request_id:Nullable(String)})
ORDER BY t_ns DESC
LIMIT 2000
