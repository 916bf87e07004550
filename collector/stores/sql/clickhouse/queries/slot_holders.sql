-- Requests of one instance that held a batch slot at some point of [t0_ns, t1_ns): admitted (end of
-- their last llm.queue: behind a gateway, the engine's admission after the gateway's; else arrival
-- + queue_ms) before t1 and finished after t0. One row per request, the observers' views merged
-- (fragments/request_rows.sql; a gateway's row starts up to 10 minutes before its engine's).
-- DuckDB's CAST rounds half away from zero (ClickHouse's truncates), hence the explicit rounding.
WITH inside AS (
    SELECT *
    FROM requests
    WHERE (observer IS NULL OR observer != 'gateway')
      AND instance_id = {instance_id:Nullable(String)}
      AND end_ns > {t0_ns:Nullable(Int64)}
      AND start_ns < {t1_ns:Nullable(Int64)} + 600000000000
), outside AS (
    SELECT *
    FROM requests
    WHERE observer = 'gateway'
      AND end_ns > {t0_ns:Nullable(Int64)}
      AND start_ns < {t1_ns:Nullable(Int64)}
      AND (instance_id = {instance_id:Nullable(String)} OR request_id IN (SELECT request_id FROM inside))
),
-- include: request_rows
, candidates AS (
    SELECT request_id, prompt_tokens, cached_tokens, completion_tokens, start_ns, end_ns, queue_ms
    FROM request_rows
    WHERE instance_id = {instance_id:Nullable(String)}
      AND request_id <> {request_id:Nullable(String)}
      AND end_ns > {t0_ns:Nullable(Int64)}
      AND start_ns < {t1_ns:Nullable(Int64)}
)
SELECT request_id, prompt_tokens, cached_tokens, completion_tokens, start_ns, end_ns, admitted_ns
FROM (
    SELECT c.request_id AS request_id, c.prompt_tokens AS prompt_tokens, c.cached_tokens AS cached_tokens,
           c.completion_tokens AS completion_tokens, c.start_ns AS start_ns, c.end_ns AS end_ns,
           coalesce(q.end_ns, c.start_ns + toInt64(if(coalesce(c.queue_ms, 0) >= 0,
                                                      floor(coalesce(c.queue_ms, 0) * 1e6 + 0.5),
                                                      ceil(coalesce(c.queue_ms, 0) * 1e6 - 0.5)))) AS admitted_ns
    FROM candidates AS c
    -- Only the queue spans of the requests in question (without the IN, ClickHouse builds the join's
    -- right side from every llm.queue span ever stored); the last one per request.
    LEFT JOIN (
        SELECT request_id, max(end_ns) AS end_ns FROM phases
        WHERE name = 'llm.queue'
          AND request_id IN (SELECT request_id FROM candidates)
        GROUP BY request_id
    ) AS q ON q.request_id = c.request_id
)
WHERE admitted_ns < {t1_ns:Nullable(Int64)}
ORDER BY admitted_ns
