-- Phase spans of one request, by start time. [t0_ns, t1_ns] is the request's own span: children
-- lie inside it, and the window lets DuckDB skip row groups by their min/max times.
SELECT *
FROM phases
WHERE request_id = $request_id AND start_ns BETWEEN $t0_ns AND $t1_ns
ORDER BY start_ns, name
