-- Stored spans of these traces that started at these times: the writer's exact check of spans it
-- cannot rule out from memory (collector/stores/once.py); trace_id leads the primary key of spans.
SELECT trace_id, span_id, start_ns
FROM spans
WHERE trace_id IN {traces:Array(String)} AND start_ns IN {starts:Array(Int64)}
ORDER BY trace_id, span_id, start_ns
