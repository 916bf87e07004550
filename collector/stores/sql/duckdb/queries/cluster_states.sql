-- The latest cluster.state span of every upstream that sent one: a multi-node engine's placement and
-- readiness (Exo), sent by the gateway's adapter when it changed (docs/gateway.md).
SELECT s.instance_id, s.end_ns AS t_ns, s.attributes
FROM spans s
JOIN (SELECT instance_id, max(end_ns) AS end_ns FROM spans WHERE name = 'cluster.state' GROUP BY instance_id) latest
  ON latest.instance_id = s.instance_id AND latest.end_ns = s.end_ns
WHERE s.name = 'cluster.state'
ORDER BY s.instance_id
