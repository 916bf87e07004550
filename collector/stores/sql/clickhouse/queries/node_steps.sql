-- The steps a distributed instance's nodes timed while a request prefilled or decoded in them
-- (duckdb/queries/node_steps.sql).
SELECT instance_id, start_ns, duration_ns, compute_ns, ring_wait_ns, ring_wait_cpu_ns,
       toBool(has(prefill_request_ids, {request_id:Nullable(String)})) AS prefilling,
       toBool(has(decode_request_ids, {request_id:Nullable(String)})) AS decoding
FROM steps
WHERE (instance_id = {instance_id:Nullable(String)}
       OR startsWith(instance_id, concat({instance_id:Nullable(String)}, '/rank')))
  AND start_ns >= {t0_ns:Nullable(Int64)}
  AND start_ns <= {t1_ns:Nullable(Int64)}
  AND compute_ns IS NOT NULL
  AND (has(prefill_request_ids, {request_id:Nullable(String)}) OR has(decode_request_ids, {request_id:Nullable(String)}))
ORDER BY instance_id, start_ns
