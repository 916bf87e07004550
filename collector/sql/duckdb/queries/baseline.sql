-- Recent finished requests of one instance before a moment: the instance's own baseline.
SELECT request_id, start_ns, queue_ms, load_wait_ms, prefill_ms, decode_ms, tpot_ms, prompt_tokens,
       cached_tokens, completion_tokens, http_status, error_type, finish_reason, client_disconnected
FROM requests
WHERE instance_id = $instance_id
  AND request_id <> $request_id
  AND start_ns >= $since_ns
  AND start_ns < $before_ns
  AND (http_status IS NULL OR http_status < 400)
ORDER BY start_ns DESC
LIMIT $limit
