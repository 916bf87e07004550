-- Keys of the spans that started at or after since_ns: the writer's memory at start (collector/once.py).
SELECT trace_id, span_id, start_ns
FROM spans
WHERE ($since_ns::BIGINT IS NULL OR start_ns >= $since_ns)
ORDER BY trace_id, span_id, start_ns
