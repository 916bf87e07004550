-- The requests of one session, oldest first: the turns of ``analyze session``; one row per request,
-- the observers' views merged (fragments/request_rows.sql).
WITH inside AS (
    SELECT * FROM requests WHERE session_id = {session_id:Nullable(String)} AND (observer IS NULL OR observer != 'gateway')
), outside AS (
    SELECT * FROM requests WHERE session_id = {session_id:Nullable(String)} AND observer = 'gateway'
),
-- include: request_rows
SELECT *
FROM request_rows
ORDER BY start_ns, request_id
