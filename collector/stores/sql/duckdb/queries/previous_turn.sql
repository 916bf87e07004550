-- The latest request of a session that started before a moment (the conversation's previous turn);
-- one row per request, the observers' views merged (fragments/request_rows.sql).
WITH inside AS MATERIALIZED (
    SELECT * FROM requests WHERE session_id = $session_id AND observer IS DISTINCT FROM 'gateway'
), outside AS MATERIALIZED (
    SELECT * FROM requests WHERE session_id = $session_id AND observer = 'gateway'
),
-- include: request_rows
SELECT request_id, instance_id, start_ns, end_ns
FROM request_rows
WHERE start_ns < $before_ns AND request_id <> $request_id
ORDER BY start_ns DESC
LIMIT 1
