SELECT *
FROM cache_lookups
WHERE request_id = $request_id AND start_ns BETWEEN $t0_ns AND $t1_ns
ORDER BY start_ns DESC
LIMIT 1
