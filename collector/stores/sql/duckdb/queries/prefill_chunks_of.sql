SELECT *
FROM prefill_chunks
WHERE request_id = $request_id AND start_ns BETWEEN $t0_ns AND $t1_ns
ORDER BY start_ns
