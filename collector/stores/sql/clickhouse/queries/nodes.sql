-- Every node of a distributed engine, with its latest resource attributes, shard placement and
-- weight bytes (duckdb/queries/nodes.sql). join_use_nulls (store_clickhouse.py) gives the NULL
-- placement and weights DuckDB gives.
SELECT r.instance_id AS instance_id, r.host_name AS host_name, r.node_attributes AS node_attributes,
       p.shard_attributes AS shard_attributes, w.weight_bytes AS weight_bytes
FROM (SELECT instance_id, argMax(host_name, seen_ns) AS host_name, argMax(attributes, seen_ns) AS node_attributes
      FROM resources
      WHERE instance_id IS NOT NULL AND attributes LIKE '%"tokentrace.node.of"%'
      GROUP BY instance_id) AS r
LEFT JOIN (SELECT instance_id, argMax(attributes, start_ns) AS shard_attributes
           FROM spans WHERE name = 'model.load.shard' GROUP BY instance_id) AS p
  ON p.instance_id = r.instance_id
LEFT JOIN (SELECT instance_id, argMax(bytes, start_ns) AS weight_bytes
           FROM load_stages WHERE name = 'model.load.weights' AND bytes IS NOT NULL GROUP BY instance_id) AS w
  ON w.instance_id = r.instance_id
ORDER BY instance_id
