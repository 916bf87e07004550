-- The requests of one session, oldest first: the turns of ``analyze session``.
SELECT *
FROM requests
WHERE session_id = {session_id:Nullable(String)}
ORDER BY start_ns, request_id
