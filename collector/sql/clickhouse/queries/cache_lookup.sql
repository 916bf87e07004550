SELECT *
FROM cache_lookups
WHERE request_id = {request_id:Nullable(String)}
ORDER BY start_ns DESC
LIMIT 1
