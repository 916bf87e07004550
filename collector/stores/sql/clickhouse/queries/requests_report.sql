-- The requests named query (one row per request, merged) with only the columns the window report
-- reads (analyzers/report.py): an hour of a busy store is ~185,000 rows, and the other columns (ids,
-- JSON, strings) cost 60 % of fetching them (issue 17). A slice (issue 47) keeps the merged requests of
-- one model, session or request-id prefix (each NULL: any).
WITH inside AS (
    SELECT *
    FROM requests
    WHERE (observer IS NULL OR observer != 'gateway')
      AND ({since_ns:Nullable(Int64)} IS NULL OR start_ns >= {since_ns:Nullable(Int64)})
      AND ({until_ns:Nullable(Int64)} IS NULL OR start_ns < {until_ns:Nullable(Int64)} + 600000000000)
      AND ({instance_id:Nullable(String)} IS NULL OR instance_id = {instance_id:Nullable(String)})
), outside AS (
    SELECT *
    FROM requests
    WHERE observer = 'gateway'
      AND ({since_ns:Nullable(Int64)} IS NULL OR start_ns >= {since_ns:Nullable(Int64)} - 600000000000)
      AND ({until_ns:Nullable(Int64)} IS NULL OR start_ns < {until_ns:Nullable(Int64)})
      AND ({instance_id:Nullable(String)} IS NULL OR instance_id = {instance_id:Nullable(String)}
           OR request_id IN (SELECT request_id FROM inside))
),
-- include: request_rows
SELECT *
FROM (
    SELECT request_id, instance_id, model, start_ns, end_ns, queue_ms, load_wait_ms, prefill_ms, decode_ms, ttft_ms,
           tpot_ms, prompt_tokens, cached_tokens, completion_tokens, finish_reason, client_disconnected, http_status,
           error_type, first_content_ms
    FROM request_rows
    WHERE ({since_ns:Nullable(Int64)} IS NULL OR start_ns >= {since_ns:Nullable(Int64)})
      AND ({until_ns:Nullable(Int64)} IS NULL OR start_ns < {until_ns:Nullable(Int64)})
      AND ({instance_id:Nullable(String)} IS NULL OR instance_id = {instance_id:Nullable(String)})
      AND ({model:Nullable(String)} IS NULL OR model = {model:Nullable(String)})
      AND ({session_id:Nullable(String)} IS NULL OR session_id = {session_id:Nullable(String)})
      AND ({request_prefix:Nullable(String)} IS NULL OR startsWith(request_id, {request_prefix:Nullable(String)}))
    ORDER BY start_ns DESC
    LIMIT {limit:UInt64}
)
ORDER BY start_ns
