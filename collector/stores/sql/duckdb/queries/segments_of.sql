SELECT segment_index, role, token_start, token_end, hash, snippet, tail_hash
FROM segments
WHERE request_id = $request_id AND t_ns BETWEEN $t0_ns AND $t1_ns
ORDER BY segment_index
