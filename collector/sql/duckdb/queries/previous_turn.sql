-- The latest request of a session that started before a moment (the conversation's previous turn).
SELECT request_id, instance_id, start_ns, end_ns
FROM requests
WHERE session_id = $session_id AND start_ns < $before_ns AND request_id <> $request_id
ORDER BY start_ns DESC
LIMIT 1
