-- Every node of a distributed engine: an instance whose resource names the instance it is a node of
-- (tokentrace.node.of; rank 0 is the instance itself, the ranks above it report as <instance>/rank<r>),
-- with its latest resource attributes (rank, ranks, host), the attributes of its latest
-- model.load.shard (what it holds) and its latest weight bytes: the instances page's nodes (issue 46).
SELECT r.instance_id, r.host_name, r.node_attributes, p.shard_attributes, w.weight_bytes
FROM (SELECT instance_id, arg_max(host_name, seen_ns) AS host_name, arg_max(attributes, seen_ns) AS node_attributes
      FROM resources
      WHERE instance_id IS NOT NULL AND attributes LIKE '%"tokentrace.node.of"%'
      GROUP BY instance_id) AS r
LEFT JOIN (SELECT instance_id, arg_max(attributes, start_ns) AS shard_attributes
           FROM spans WHERE name = 'model.load.shard' GROUP BY instance_id) AS p
  ON p.instance_id = r.instance_id
LEFT JOIN (SELECT instance_id, arg_max(bytes, start_ns) AS weight_bytes
           FROM load_stages WHERE name = 'model.load.weights' AND bytes IS NOT NULL GROUP BY instance_id) AS w
  ON w.instance_id = r.instance_id
ORDER BY r.instance_id
