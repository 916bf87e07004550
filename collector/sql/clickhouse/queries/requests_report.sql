-- The requests named query with only the columns the window report reads (analyzers/report.py):
-- an hour of a busy store is ~185,000 rows, and the other columns (ids, JSON, strings) cost 60 % of
-- fetching them (issue 17).
SELECT *
FROM (
    SELECT request_id, instance_id, model, start_ns, end_ns, queue_ms, load_wait_ms, prefill_ms, decode_ms, ttft_ms,
           tpot_ms, prompt_tokens, cached_tokens, completion_tokens, finish_reason, client_disconnected, http_status,
           error_type
    FROM requests
    WHERE ({since_ns:Nullable(Int64)} IS NULL OR start_ns >= {since_ns:Nullable(Int64)})
      AND ({until_ns:Nullable(Int64)} IS NULL OR start_ns < {until_ns:Nullable(Int64)})
      AND ({instance_id:Nullable(String)} IS NULL OR instance_id = {instance_id:Nullable(String)})
    ORDER BY start_ns DESC
    LIMIT {limit:UInt64}
)
ORDER BY start_ns
