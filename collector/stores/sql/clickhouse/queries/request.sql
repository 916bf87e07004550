-- One request's row: one row however many observers saw it, their views merged
-- (fragments/request_rows.sql); among rows of one observer, the latest (a sender's resend).
-- Same rows as the DuckDB twin.
WITH hits AS (
    SELECT *
    FROM requests
    WHERE request_id = {request_id:Nullable(String)}
), inside AS (
    SELECT * FROM hits WHERE (observer IS NULL OR observer != 'gateway')
    ORDER BY multiIf(observer = 'native', 1, 0), end_ns DESC
    LIMIT 1
), outside AS (
    SELECT * FROM hits WHERE observer = 'gateway'
    ORDER BY end_ns DESC
    LIMIT 1
),
-- include: request_rows
SELECT *
FROM request_rows
