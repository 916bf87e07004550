-- Requests that shared engine steps with one request on its instance in [t0_ns, t1_ns]: how many
-- steps, in how many of them the other request was prefilling or decoding, their total time.
WITH shared AS (
    SELECT prefill_request_ids, decode_request_ids, duration_ns
    FROM steps
    WHERE instance_id = $instance_id AND start_ns >= $t0_ns AND start_ns <= $t1_ns
      AND (list_contains(prefill_request_ids, $request_id) OR list_contains(decode_request_ids, $request_id))
), members AS (
    SELECT unnest(prefill_request_ids) AS request_id, 1 AS prefill, 0 AS decode, duration_ns FROM shared
    UNION ALL
    SELECT unnest(decode_request_ids) AS request_id, 0 AS prefill, 1 AS decode, duration_ns FROM shared
)
-- sum() of integers is HUGEINT in DuckDB (Int128 by row fetch, Decimal by Arrow): BIGINT, as on ClickHouse.
SELECT m.request_id, count(*) AS steps, CAST(sum(m.prefill) AS BIGINT) AS prefill_steps,
       CAST(sum(m.decode) AS BIGINT) AS decode_steps, CAST(sum(m.duration_ns) AS BIGINT) AS step_ns,
       any_value(r.prompt_tokens) AS prompt_tokens,
       any_value(r.cached_tokens) AS cached_tokens, any_value(r.completion_tokens) AS completion_tokens
FROM members m
LEFT JOIN requests r ON r.request_id = m.request_id
WHERE m.request_id <> $request_id
GROUP BY m.request_id
ORDER BY steps DESC, m.request_id
