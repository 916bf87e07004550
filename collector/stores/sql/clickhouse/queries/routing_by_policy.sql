-- Per routing policy, over gateway decisions that started in [since_ns, until_ns): decisions, the
-- avoidable prefill summed (prompt tokens another upstream held that the chosen one recomputed),
-- how many decisions had any, how many were measured at all, and the mean gateway wait. A slice keeps
-- the decisions for one instance (the upstream chosen), session, request-id prefix or model (each
-- NULL: any).
-- (Columns are renamed inside: ClickHouse would let an output alias shadow the column it sums.)
SELECT policy,
       toInt64(count(*)) AS decisions,
       toInt64(sum(avoidable)) AS avoidable_prefill_tokens,
       toInt64(countIf(avoidable > 0)) AS decisions_with_avoidable,
       toInt64(count(avoidable)) AS decisions_measured,
       avg(wait) AS mean_gateway_wait_ms
FROM (
    SELECT policy, avoidable_prefill_tokens AS avoidable, gateway_wait_ms AS wait
    FROM routes
    WHERE ({since_ns:Nullable(Int64)} IS NULL OR start_ns >= {since_ns:Nullable(Int64)})
      AND ({until_ns:Nullable(Int64)} IS NULL OR start_ns < {until_ns:Nullable(Int64)})
      AND ({instance_id:Nullable(String)} IS NULL OR instance_id = {instance_id:Nullable(String)})
      AND ({session_id:Nullable(String)} IS NULL OR session_id = {session_id:Nullable(String)})
      AND ({request_prefix:Nullable(String)} IS NULL OR startsWith(request_id, {request_prefix:Nullable(String)}))
      AND ({model:Nullable(String)} IS NULL
           OR request_id IN (SELECT request_id FROM requests WHERE model = {model:Nullable(String)}))
)
GROUP BY policy
ORDER BY policy
