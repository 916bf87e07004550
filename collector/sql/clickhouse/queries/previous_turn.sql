-- The latest request of a session that started before a moment (the conversation's previous turn).
SELECT request_id, instance_id, start_ns, end_ns
FROM requests
WHERE session_id = {session_id:Nullable(String)} AND start_ns < {before_ns:Nullable(Int64)}
  AND request_id <> {request_id:Nullable(String)}
ORDER BY start_ns DESC
LIMIT 1
