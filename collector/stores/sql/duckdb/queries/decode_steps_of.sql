-- One request's token times, by step: its llm.decode starts inside the request's window, so the
-- packed row is found by its start (zone maps on start_ns) before its offsets are expanded.
SELECT step, t_ns
FROM (
    SELECT generate_subscripts(offsets, 1) - 1 AS step, start_ns + unnest(offsets) AS t_ns
    FROM decode_step_lists
    WHERE request_id = $request_id AND start_ns BETWEEN $t0_ns AND $t1_ns
)
WHERE t_ns BETWEEN $t0_ns AND $t1_ns
ORDER BY step
