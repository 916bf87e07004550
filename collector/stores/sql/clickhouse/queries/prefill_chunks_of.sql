SELECT *
FROM prefill_chunks
WHERE request_id = {request_id:Nullable(String)}
  AND start_ns BETWEEN {t0_ns:Nullable(Int64)} AND {t1_ns:Nullable(Int64)}
ORDER BY start_ns
