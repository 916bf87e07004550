SELECT *
FROM prefill_chunks
WHERE request_id = {request_id:Nullable(String)}
ORDER BY start_ns
