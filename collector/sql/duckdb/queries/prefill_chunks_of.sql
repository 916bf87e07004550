SELECT *
FROM prefill_chunks
WHERE request_id = $request_id
ORDER BY start_ns
