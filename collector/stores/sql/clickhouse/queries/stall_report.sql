-- A distributed instance's last stall report in [t0_ns, t1_ns] (duckdb/queries/stall_report.sql).
SELECT start_ns AS t_ns, attributes
FROM spans
WHERE name = 'instance.heartbeat' AND instance_id = {instance_id:Nullable(String)}
  AND start_ns >= {t0_ns:Nullable(Int64)} AND start_ns <= {t1_ns:Nullable(Int64)}
  AND position(attributes, '"tokentrace.stall.state"') > 0
ORDER BY start_ns DESC
LIMIT 1
