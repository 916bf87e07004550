-- Requests of one instance that held a batch slot at some point of [t0_ns, t1_ns): admitted (end of
-- their last llm.queue: behind a gateway, the engine's admission after the gateway's; else arrival
-- + queue_ms) before t1 and finished after t0. One row per request, the observers' views merged
-- (fragments/request_rows.sql; a gateway's row starts up to 10 minutes before its engine's).
-- The queue spans are read only between the candidates' earliest start and latest end, give or take
-- a minute of clock skew between a request's span and its own queue span: phases are stored in time
-- order, so the scan skips the rest of the store (1.25M requests: 52 -> 9 ms, 2 of 63 row groups)
-- instead of reading every llm.queue span ever stored.
WITH inside AS MATERIALIZED (
    SELECT *
    FROM requests
    WHERE observer IS DISTINCT FROM 'gateway'
      AND instance_id = $instance_id
      AND end_ns > $t0_ns
      AND start_ns < $t1_ns + 600000000000
), outside AS MATERIALIZED (
    SELECT *
    FROM requests
    WHERE observer = 'gateway'
      AND end_ns > $t0_ns
      AND start_ns < $t1_ns
      AND (instance_id = $instance_id OR request_id IN (SELECT request_id FROM inside))
),
-- include: request_rows
, candidates AS MATERIALIZED (
    SELECT request_id, prompt_tokens, cached_tokens, completion_tokens, start_ns, end_ns, queue_ms
    FROM request_rows
    WHERE instance_id = $instance_id
      AND request_id <> $request_id
      AND end_ns > $t0_ns
      AND start_ns < $t1_ns
)
SELECT request_id, prompt_tokens, cached_tokens, completion_tokens, start_ns, end_ns, admitted_ns
FROM (
    SELECT c.request_id, c.prompt_tokens, c.cached_tokens, c.completion_tokens, c.start_ns, c.end_ns,
           coalesce(q.end_ns, c.start_ns + CAST(coalesce(c.queue_ms, 0) * 1e6 AS BIGINT)) AS admitted_ns
    FROM candidates c
    LEFT JOIN (
        SELECT request_id, max(end_ns) AS end_ns FROM phases
        WHERE name = 'llm.queue'
          -- No candidates: an empty range (a NULL bound would read every row group).
          AND end_ns >= coalesce((SELECT min(start_ns) FROM candidates) - 60000000000, 9223372036854775807)
          AND start_ns <= coalesce((SELECT max(end_ns) FROM candidates) + 60000000000, -9223372036854775808)
        GROUP BY request_id
    ) q ON q.request_id = c.request_id
)
WHERE admitted_ns < $t1_ns
ORDER BY admitted_ns
