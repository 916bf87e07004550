-- Keys of the spans that ended at or after since_ns: the writer's memory at start (collector/stores/once.py).
SELECT trace_id, span_id, end_ns
FROM spans
WHERE ($since_ns::BIGINT IS NULL OR end_ns >= $since_ns)
ORDER BY trace_id, span_id, end_ns
