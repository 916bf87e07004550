-- One model load with its stages; the load row repeats on every stage row (no stage: one row, NULL stage).
SELECT l.load_id, l.instance_id, l.start_ns, l.end_ns, l.lazy, l.model_path,
       s.name AS stage, s.start_ns AS stage_start_ns, s.end_ns AS stage_end_ns
FROM model_loads l
LEFT JOIN load_stages s ON s.load_id = l.load_id AND s.instance_id IS NOT DISTINCT FROM l.instance_id
WHERE l.load_id = $load_id
ORDER BY s.start_ns
