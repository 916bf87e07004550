-- Keys of the spans that started at or after since_ns: the writer's memory at start (collector/once.py).
SELECT trace_id, span_id, start_ns
FROM spans
WHERE ({since_ns:Nullable(Int64)} IS NULL OR start_ns >= {since_ns:Nullable(Int64)})
ORDER BY trace_id, span_id, start_ns
