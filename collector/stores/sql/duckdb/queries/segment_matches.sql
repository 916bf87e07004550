-- Earlier requests' segments whose content hash equals one of the given hashes.
-- The other filters stay outside the MATERIALIZED CTE so that DuckDB takes the ART index on hash
-- (see prefix_sightings_of.sql).
WITH hits AS MATERIALIZED (
    SELECT request_id, instance_id, t_ns, segment_index, role, token_start, token_end, hash
    FROM segments
    WHERE hash IN ($hashes[])
)
SELECT request_id, instance_id, t_ns, segment_index, role, token_start, token_end, hash
FROM hits
WHERE t_ns < $before_ns
  AND request_id IS DISTINCT FROM $request_id
ORDER BY t_ns DESC
LIMIT 2000
