-- Per instance, the resource attributes (JSON) of its latest export: what its observer declares
-- (tokentrace.observer.measures, docs/telemetry.md).
SELECT instance_id, arg_max(attributes, seen_ns) AS attributes
FROM resources
WHERE instance_id IS NOT NULL
  AND ($instance_id::VARCHAR IS NULL OR instance_id = $instance_id)
GROUP BY instance_id
ORDER BY instance_id
