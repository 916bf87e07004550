-- The steps a distributed instance's nodes (the instance itself, rank 0, and its ranks above 0,
-- which report as <instance>/rank<r>) timed in [t0_ns, t1_ns] while a request prefilled or decoded
-- in them: each rank's compute, its waits on the ring and the CPU it used in them (issue 46).
SELECT instance_id, start_ns, duration_ns, compute_ns, ring_wait_ns, ring_wait_cpu_ns,
       list_contains(prefill_request_ids, $request_id) AS prefilling,
       list_contains(decode_request_ids, $request_id) AS decoding
FROM steps
WHERE (instance_id = $instance_id OR starts_with(instance_id, $instance_id || '/rank'))
  AND start_ns >= $t0_ns
  AND start_ns <= $t1_ns
  AND compute_ns IS NOT NULL
  AND (list_contains(prefill_request_ids, $request_id) OR list_contains(decode_request_ids, $request_id))
ORDER BY instance_id, start_ns
