-- The resource attributes (JSON) an instance exported with for a span that ended at t_ns: its first
-- export seen at or after t_ns (an export's seen_ns is its latest span end, so the export carrying
-- that span qualifies, and a later process of the same instance id exports only after it).
SELECT attributes
FROM resources
WHERE instance_id = $instance_id AND seen_ns >= $t_ns
ORDER BY seen_ns
LIMIT 1
