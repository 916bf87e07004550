-- One request's row; the latest if a sender resent it.
-- The MATERIALIZED CTE keeps the point lookup on the requests_request_id index: written as one
-- SELECT ... ORDER BY end_ns DESC LIMIT 1, DuckDB 2.0 plans it as a Top N over a sequential scan of
-- every request id (late materialization), which grows with the store (issue 17). Same rows as the
-- ClickHouse twin.
WITH hits AS MATERIALIZED (
    SELECT *
    FROM requests
    WHERE request_id = $request_id
)
SELECT *
FROM hits
ORDER BY end_ns DESC
LIMIT 1
