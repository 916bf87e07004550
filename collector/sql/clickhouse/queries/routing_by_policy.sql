-- Per routing policy, over gateway decisions that started in [since_ns, until_ns): decisions, the
-- avoidable prefill summed (prompt tokens another upstream held that the chosen one recomputed),
-- how many decisions had any, how many were measured at all, and the mean gateway wait.
SELECT policy,
       count(*) AS decisions,
       sum(avoidable_prefill_tokens) AS avoidable_prefill_tokens,
       countIf(avoidable_prefill_tokens > 0) AS decisions_with_avoidable,
       count(avoidable_prefill_tokens) AS decisions_measured,
       avg(gateway_wait_ms) AS mean_gateway_wait_ms
FROM routes
WHERE ({since_ns:Nullable(Int64)} IS NULL OR start_ns >= {since_ns:Nullable(Int64)})
  AND ({until_ns:Nullable(Int64)} IS NULL OR start_ns < {until_ns:Nullable(Int64)})
GROUP BY policy
ORDER BY policy
