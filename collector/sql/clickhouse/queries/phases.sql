-- Phase spans of one request (llm.queue, llm.load_wait, llm.cache.lookup, llm.prefill, llm.decode,
-- llm.cache.insert), by start time.
SELECT *
FROM phases
WHERE request_id = {request_id:Nullable(String)}
ORDER BY start_ns, name
