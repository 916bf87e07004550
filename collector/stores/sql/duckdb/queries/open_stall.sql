-- A request not stored yet that a distributed engine's rank 0 reports it holds open while its ring
-- has not moved (tokentrace.requests.open on its heartbeats, issue 46): the latest heartbeat, since
-- $since_ns, of the instance whose heartbeats last named it, with its attributes (the stall, when it
-- still holds). The caller checks the id against the parsed list (a substring here).
WITH named AS (
    SELECT instance_id FROM spans
    WHERE name = 'instance.heartbeat' AND start_ns >= $since_ns
      AND contains(attributes, '"tokentrace.requests.open"') AND contains(attributes, '"' || $request_id || '"')
    ORDER BY start_ns DESC
    LIMIT 1
)
SELECT s.instance_id AS instance_id, s.start_ns AS t_ns, s.attributes AS attributes
FROM spans AS s
WHERE s.name = 'instance.heartbeat' AND s.start_ns >= $since_ns AND s.instance_id IN (SELECT instance_id FROM named)
ORDER BY s.start_ns DESC
LIMIT 1
