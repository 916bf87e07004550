-- Earlier requests' segments whose tail hash (their last block of tokens) equals one of the given
-- ones: messages that end like this prompt's, whatever came before (015_segment_tails.sql). The
-- other filters stay outside the MATERIALIZED CTE so that DuckDB takes the ART index on tail_hash
-- (see segment_matches.sql).
WITH hits AS MATERIALIZED (
    SELECT request_id, instance_id, t_ns, segment_index, role, token_start, token_end, hash, tail_hash
    FROM segments
    WHERE tail_hash IN ($tails[])
)
SELECT request_id, instance_id, t_ns, segment_index, role, token_start, token_end, hash, tail_hash
FROM hits
WHERE t_ns < $before_ns
  AND request_id IS DISTINCT FROM $request_id
ORDER BY t_ns DESC
LIMIT 200
