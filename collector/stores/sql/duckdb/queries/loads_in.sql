-- Model loads that overlap [since_ns, until_ns) (NULL: unbounded), one row per stage (a load without
-- stages: one row, NULL stage), by load start then stage start.
SELECT l.load_id, l.instance_id, l.start_ns, l.end_ns, l.lazy, l.model_path,
       s.name AS stage, s.start_ns AS stage_start_ns, s.end_ns AS stage_end_ns
FROM model_loads l
LEFT JOIN load_stages s ON s.load_id = l.load_id AND s.instance_id IS NOT DISTINCT FROM l.instance_id
WHERE ($since_ns::BIGINT IS NULL OR l.end_ns >= $since_ns)
  AND ($until_ns::BIGINT IS NULL OR l.start_ns < $until_ns)
ORDER BY l.start_ns, l.load_id, s.start_ns
