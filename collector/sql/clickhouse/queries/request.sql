-- One request's row; the latest if a sender resent it.
SELECT *
FROM requests
WHERE request_id = {request_id:Nullable(String)}
ORDER BY end_ns DESC
LIMIT 1
