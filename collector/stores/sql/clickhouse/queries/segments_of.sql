SELECT segment_index, role, token_start, token_end, hash, snippet, tail_hash
FROM segments
WHERE request_id = {request_id:Nullable(String)}
  AND t_ns BETWEEN {t0_ns:Nullable(Int64)} AND {t1_ns:Nullable(Int64)}
ORDER BY segment_index
