-- Requests of one instance that held a batch slot at some point of [t0_ns, t1_ns): admitted (end of
-- their llm.queue; else arrival + queue_ms) before t1 and finished after t0.
SELECT request_id, prompt_tokens, cached_tokens, completion_tokens, start_ns, end_ns, admitted_ns
FROM (
    SELECT r.request_id, r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.start_ns, r.end_ns,
           coalesce(q.end_ns, r.start_ns + CAST(coalesce(r.queue_ms, 0) * 1e6 AS BIGINT)) AS admitted_ns
    FROM requests r
    LEFT JOIN phases q ON q.request_id = r.request_id AND q.name = 'llm.queue'
    WHERE r.instance_id = $instance_id
      AND r.request_id <> $request_id
      AND r.end_ns > $t0_ns
      AND r.start_ns < $t1_ns
)
WHERE admitted_ns < $t1_ns
ORDER BY admitted_ns
