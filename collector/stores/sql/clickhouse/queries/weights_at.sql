-- The weight bytes of the model an instance served at t_ns: its latest model.load.weights stage that
-- started at or before t_ns (tokentrace.load.bytes). The decode verdict's memory traffic per step.
SELECT bytes AS weight_bytes, start_ns
FROM load_stages
WHERE instance_id = {instance_id:Nullable(String)} AND name = 'model.load.weights'
  AND start_ns <= {t_ns:Nullable(Int64)} AND bytes IS NOT NULL
ORDER BY start_ns DESC
LIMIT 1
