SELECT segment_index, role, token_start, token_end, hash, snippet
FROM segments
WHERE request_id = {request_id:Nullable(String)}
ORDER BY segment_index
