-- The segments of several requests whose prompts were looked up in [t0_ns, t1_ns]: the earlier
-- requests a cache verdict compares its prompt with, in one query instead of one per request.
SELECT request_id, t_ns, segment_index, role, token_start, token_end, hash, snippet
FROM segments
WHERE request_id IN {request_ids:Array(String)}
  AND t_ns BETWEEN {t0_ns:Nullable(Int64)} AND {t1_ns:Nullable(Int64)}
ORDER BY request_id, t_ns, segment_index
