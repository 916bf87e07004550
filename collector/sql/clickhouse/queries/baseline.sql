-- Recent finished requests of one instance before a moment: the instance's own baseline.
SELECT request_id, start_ns, queue_ms, load_wait_ms, prefill_ms, decode_ms, tpot_ms, prompt_tokens,
       cached_tokens, completion_tokens, http_status, error_type, finish_reason, client_disconnected
FROM requests
WHERE instance_id = {instance_id:Nullable(String)}
  AND request_id <> {request_id:Nullable(String)}
  AND start_ns >= {since_ns:Nullable(Int64)}
  AND start_ns < {before_ns:Nullable(Int64)}
  AND (http_status IS NULL OR http_status < 400)
ORDER BY start_ns DESC
LIMIT {limit:UInt64}
