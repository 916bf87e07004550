-- The latest heartbeat of the instance whose heartbeats last named an open request in a stall
-- (duckdb/queries/open_stall.sql).
WITH named AS (
    SELECT instance_id FROM spans
    WHERE name = 'instance.heartbeat' AND start_ns >= {since_ns:Nullable(Int64)}
      AND position(attributes, '"tokentrace.requests.open"') > 0
      AND position(attributes, concat('"', {request_id:Nullable(String)}, '"')) > 0
    ORDER BY start_ns DESC
    LIMIT 1
)
SELECT s.instance_id AS instance_id, s.start_ns AS t_ns, s.attributes AS attributes
FROM spans AS s
WHERE s.name = 'instance.heartbeat' AND s.start_ns >= {since_ns:Nullable(Int64)}
  AND s.instance_id IN (SELECT instance_id FROM named)
ORDER BY s.start_ns DESC
LIMIT 1
