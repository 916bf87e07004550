SELECT step, t_ns
FROM decode_steps
WHERE request_id = {request_id:Nullable(String)}
  AND t_ns BETWEEN {t0_ns:Nullable(Int64)} AND {t1_ns:Nullable(Int64)}
ORDER BY step
