-- Phase spans of one request, by start time. [t0_ns, t1_ns] is the request's own span: children
-- lie inside it, and the window prunes partitions and granules of (instance_id, start_ns).
SELECT *
FROM phases
WHERE request_id = {request_id:Nullable(String)}
  AND start_ns BETWEEN {t0_ns:Nullable(Int64)} AND {t1_ns:Nullable(Int64)}
ORDER BY start_ns, name
