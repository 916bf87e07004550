-- Recent finished requests of one instance before a moment: the instance's own baseline; one row per
-- request, the observers' views merged (fragments/request_rows.sql; a gateway's row starts up to 10
-- minutes before its engine's).
WITH inside AS (
    SELECT *
    FROM requests
    WHERE observer IS DISTINCT FROM 'gateway'
      AND instance_id = $instance_id
      AND start_ns >= $since_ns
      AND start_ns < $before_ns + 600000000000
), outside AS (
    SELECT *
    FROM requests
    WHERE observer = 'gateway'
      AND start_ns >= $since_ns - 600000000000
      AND start_ns < $before_ns
      AND (instance_id = $instance_id OR request_id IN (SELECT request_id FROM inside))
),
-- include: request_rows
SELECT request_id, start_ns, queue_ms, load_wait_ms, prefill_ms, decode_ms, tpot_ms, prompt_tokens,
       cached_tokens, completion_tokens, http_status, error_type, finish_reason, client_disconnected
FROM request_rows
WHERE instance_id = $instance_id
  AND request_id <> $request_id
  AND start_ns >= $since_ns
  AND start_ns < $before_ns
  AND (http_status IS NULL OR http_status < 400)
ORDER BY start_ns DESC
LIMIT $limit
