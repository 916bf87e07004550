-- Requests that shared engine steps with one request on its instance in [t0_ns, t1_ns]: how many
-- steps, in how many of them the other request was prefilling or decoding, their total time.
-- count() and sums are unsigned or wider in ClickHouse: cast to Int64, the type DuckDB's twin gives.
WITH shared AS (
    SELECT prefill_request_ids, decode_request_ids, duration_ns
    FROM steps
    WHERE instance_id = {instance_id:Nullable(String)}
      AND start_ns >= {t0_ns:Nullable(Int64)} AND start_ns <= {t1_ns:Nullable(Int64)}
      AND (has(prefill_request_ids, {request_id:Nullable(String)})
           OR has(decode_request_ids, {request_id:Nullable(String)}))
), members AS (
    SELECT arrayJoin(prefill_request_ids) AS request_id, 1 AS prefill, 0 AS decode, duration_ns FROM shared
    UNION ALL
    SELECT arrayJoin(decode_request_ids) AS request_id, 0 AS prefill, 1 AS decode, duration_ns FROM shared
)
SELECT m.request_id AS request_id, toInt64(count()) AS steps, toInt64(sum(m.prefill)) AS prefill_steps,
       toInt64(sum(m.decode)) AS decode_steps, toInt64(sum(m.duration_ns)) AS step_ns,
       any_value(r.prompt_tokens) AS prompt_tokens, any_value(r.cached_tokens) AS cached_tokens,
       any_value(r.completion_tokens) AS completion_tokens
FROM members AS m
LEFT JOIN requests AS r ON r.request_id = m.request_id
WHERE m.request_id <> {request_id:Nullable(String)}
GROUP BY m.request_id
ORDER BY steps DESC, m.request_id
