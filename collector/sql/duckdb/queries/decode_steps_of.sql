SELECT step, t_ns
FROM decode_steps
WHERE request_id = $request_id AND t_ns BETWEEN $t0_ns AND $t1_ns
ORDER BY step
