SELECT step, t_ns
FROM decode_steps
WHERE request_id = {request_id:Nullable(String)}
ORDER BY step
