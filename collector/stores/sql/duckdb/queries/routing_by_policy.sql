-- Per routing policy, over gateway decisions that started in [since_ns, until_ns): decisions, the
-- avoidable prefill summed (prompt tokens another upstream held that the chosen one recomputed),
-- how many decisions had any, how many were measured at all, and the mean gateway wait. A slice keeps
-- the decisions for one instance (the upstream chosen), session, request-id prefix or model (each
-- NULL: any).
SELECT policy,
       CAST(count(*) AS BIGINT) AS decisions,
       CAST(sum(avoidable_prefill_tokens) AS BIGINT) AS avoidable_prefill_tokens,
       CAST(count(*) FILTER (WHERE avoidable_prefill_tokens > 0) AS BIGINT) AS decisions_with_avoidable,
       CAST(count(avoidable_prefill_tokens) AS BIGINT) AS decisions_measured,
       avg(gateway_wait_ms) AS mean_gateway_wait_ms
FROM routes
WHERE ($since_ns::BIGINT IS NULL OR start_ns >= $since_ns)
  AND ($until_ns::BIGINT IS NULL OR start_ns < $until_ns)
  AND ($instance_id::VARCHAR IS NULL OR instance_id = $instance_id)
  AND ($session_id::VARCHAR IS NULL OR session_id = $session_id)
  AND ($request_prefix::VARCHAR IS NULL OR starts_with(request_id, $request_prefix))
  AND ($model::VARCHAR IS NULL OR request_id IN (SELECT request_id FROM requests WHERE model = $model))
GROUP BY policy
ORDER BY policy
