-- Stored spans of these traces that started at these times: the writer's exact check of spans it
-- cannot rule out from memory (collector/once.py). An IN list of values lets the scan skip row
-- groups by their start_ns min/max.
SELECT trace_id, span_id, start_ns
FROM spans
WHERE start_ns IN ($starts[]) AND trace_id IN ($traces[])
ORDER BY trace_id, span_id, start_ns
