-- Phase spans of the requests that started in [since_ns, until_ns) (NULL: unbounded).
SELECT p.request_id, p.instance_id, p.name, p.start_ns, p.end_ns
FROM phases AS p
WHERE p.request_id IN (
    SELECT request_id FROM requests
    WHERE ({since_ns:Nullable(Int64)} IS NULL OR start_ns >= {since_ns:Nullable(Int64)})
      AND ({until_ns:Nullable(Int64)} IS NULL OR start_ns < {until_ns:Nullable(Int64)})
)
-- name breaks ties, as in phases.sql: an engine starts a prefill and its cache lookup at one instant.
ORDER BY p.request_id, p.start_ns, p.name
