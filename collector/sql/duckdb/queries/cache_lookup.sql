SELECT *
FROM cache_lookups
WHERE request_id = $request_id
ORDER BY start_ns DESC
LIMIT 1
