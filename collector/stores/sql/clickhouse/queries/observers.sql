-- Per instance, the resource attributes (JSON) of its latest export: what its observer declares
-- (tokentrace.observer.measures, docs/telemetry.md).
SELECT instance_id, argMax(attributes, seen_ns) AS attributes
FROM resources
WHERE instance_id IS NOT NULL
  AND ({instance_id:Nullable(String)} IS NULL OR instance_id = {instance_id:Nullable(String)})
GROUP BY instance_id
ORDER BY instance_id
