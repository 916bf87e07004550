-- Requests of one instance that held a batch slot at some point of [t0_ns, t1_ns): admitted (end of
-- their llm.queue; else arrival + queue_ms) before t1 and finished after t0. DuckDB's CAST rounds
-- half away from zero (ClickHouse's truncates), hence the explicit rounding.
SELECT request_id, prompt_tokens, cached_tokens, completion_tokens, start_ns, end_ns, admitted_ns
FROM (
    SELECT r.request_id AS request_id, r.prompt_tokens AS prompt_tokens, r.cached_tokens AS cached_tokens,
           r.completion_tokens AS completion_tokens, r.start_ns AS start_ns, r.end_ns AS end_ns,
           coalesce(q.end_ns, r.start_ns + toInt64(if(coalesce(r.queue_ms, 0) >= 0,
                                                      floor(coalesce(r.queue_ms, 0) * 1e6 + 0.5),
                                                      ceil(coalesce(r.queue_ms, 0) * 1e6 - 0.5)))) AS admitted_ns
    FROM requests AS r
    -- Only the queue spans of the requests in question (the join's result is the same): without the
    -- IN, ClickHouse builds the join's right side from every llm.queue span ever stored. As DuckDB's,
    -- only those between the candidates' earliest start and latest end, give or take a minute of skew.
    LEFT JOIN (
        SELECT request_id, end_ns FROM phases
        WHERE name = 'llm.queue'
          AND request_id IN (SELECT request_id FROM requests
                             WHERE instance_id = {instance_id:Nullable(String)}
                               AND end_ns > {t0_ns:Nullable(Int64)} AND start_ns < {t1_ns:Nullable(Int64)})
          AND end_ns >= (SELECT min(start_ns) FROM requests
                         WHERE instance_id = {instance_id:Nullable(String)} AND request_id <> {request_id:Nullable(String)}
                           AND end_ns > {t0_ns:Nullable(Int64)} AND start_ns < {t1_ns:Nullable(Int64)}) - 60000000000
          AND start_ns <= (SELECT max(end_ns) FROM requests
                           WHERE instance_id = {instance_id:Nullable(String)} AND request_id <> {request_id:Nullable(String)}
                             AND end_ns > {t0_ns:Nullable(Int64)} AND start_ns < {t1_ns:Nullable(Int64)}) + 60000000000
    ) AS q ON q.request_id = r.request_id
    WHERE r.instance_id = {instance_id:Nullable(String)}
      AND r.request_id <> {request_id:Nullable(String)}
      AND r.end_ns > {t0_ns:Nullable(Int64)}
      AND r.start_ns < {t1_ns:Nullable(Int64)}
)
WHERE admitted_ns < {t1_ns:Nullable(Int64)}
ORDER BY admitted_ns
