-- Per routing policy, over gateway decisions that started in [since_ns, until_ns): decisions, the
-- avoidable prefill summed (prompt tokens another upstream held that the chosen one recomputed),
-- how many decisions had any, how many were measured at all, and the mean gateway wait.
SELECT policy,
       CAST(count(*) AS BIGINT) AS decisions,
       CAST(sum(avoidable_prefill_tokens) AS BIGINT) AS avoidable_prefill_tokens,
       CAST(count(*) FILTER (WHERE avoidable_prefill_tokens > 0) AS BIGINT) AS decisions_with_avoidable,
       CAST(count(avoidable_prefill_tokens) AS BIGINT) AS decisions_measured,
       avg(gateway_wait_ms) AS mean_gateway_wait_ms
FROM routes
WHERE ($since_ns::BIGINT IS NULL OR start_ns >= $since_ns)
  AND ($until_ns::BIGINT IS NULL OR start_ns < $until_ns)
GROUP BY policy
ORDER BY policy
