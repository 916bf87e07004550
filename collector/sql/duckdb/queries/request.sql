-- One request's row. Should two observers have sent one (e.g. a gateway that did not know its
-- upstream reports itself), the inside view wins: engine or plugin, then vLLM's native span, then
-- the gateway; among equals the latest (a sender's resend).
-- The MATERIALIZED CTE keeps the point lookup on the requests_request_id index: written as one
-- SELECT ... ORDER BY ... LIMIT 1, DuckDB 2.0 plans it as a Top N over a sequential scan of every
-- request id (late materialization), which grows with the store (issue 17). Same rows as the
-- ClickHouse twin.
WITH hits AS MATERIALIZED (
    SELECT *
    FROM requests
    WHERE request_id = $request_id
)
SELECT *
FROM hits
ORDER BY CASE observer WHEN 'gateway' THEN 2 WHEN 'native' THEN 1 ELSE 0 END, end_ns DESC
LIMIT 1
