-- Model loads that overlap [since_ns, until_ns) (NULL: unbounded), one row per stage (a load without
-- stages: one row, NULL stage), by load start then stage start.
-- join_use_nulls (store_clickhouse.py) gives the NULL stage columns DuckDB gives.
SELECT l.load_id, l.instance_id, l.start_ns, l.end_ns, l.lazy, l.model_path,
       s.name AS stage, s.start_ns AS stage_start_ns, s.end_ns AS stage_end_ns
FROM model_loads AS l
LEFT JOIN load_stages AS s ON s.load_id = l.load_id AND isNotDistinctFrom(s.instance_id, l.instance_id)
WHERE ({since_ns:Nullable(Int64)} IS NULL OR l.end_ns >= {since_ns:Nullable(Int64)})
  AND ({until_ns:Nullable(Int64)} IS NULL OR l.start_ns < {until_ns:Nullable(Int64)})
ORDER BY l.start_ns, l.load_id, s.start_ns
