-- Earlier requests' segments whose content hash equals one of the given hashes.
SELECT request_id, instance_id, t_ns, segment_index, role, token_start, token_end, hash
FROM segments
WHERE hash IN ($hashes[])
  AND t_ns < $before_ns
  AND request_id IS DISTINCT FROM $request_id
ORDER BY t_ns DESC
LIMIT 2000
