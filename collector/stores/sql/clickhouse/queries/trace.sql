-- Every span of one trace, parents before children at equal start times.
SELECT *
FROM spans
WHERE trace_id = {trace_id:Nullable(String)}
ORDER BY start_ns, parent_span_id NULLS FIRST
