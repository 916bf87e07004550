-- One request's row: one row however many observers saw it, their views merged
-- (fragments/request_rows.sql); among rows of one observer, the latest (a sender's resend).
-- The MATERIALIZED CTEs keep the point lookup on the requests_request_id index: written as one
-- SELECT ... ORDER BY ... LIMIT 1, DuckDB 2.0 plans it as a Top N over a sequential scan of every
-- request id (late materialization), which grows with the store (issue 17). Same rows as the
-- ClickHouse twin.
WITH hits AS MATERIALIZED (
    SELECT *
    FROM requests
    WHERE request_id = $request_id
), inside AS MATERIALIZED (
    SELECT * FROM hits WHERE observer IS DISTINCT FROM 'gateway'
    ORDER BY CASE observer WHEN 'native' THEN 1 ELSE 0 END, end_ns DESC
    LIMIT 1
), outside AS MATERIALIZED (
    SELECT * FROM hits WHERE observer = 'gateway'
    ORDER BY end_ns DESC
    LIMIT 1
),
-- include: request_rows
SELECT *
FROM request_rows
