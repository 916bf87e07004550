-- One request's row. Should two observers have sent one (e.g. a gateway that did not know its
-- upstream reports itself), the inside view wins: engine or plugin, then vLLM's native span, then
-- the gateway; among equals the latest (a sender's resend).
SELECT *
FROM requests
WHERE request_id = {request_id:Nullable(String)}
ORDER BY multiIf(observer = 'gateway', 2, observer = 'native', 1, 0), end_ns DESC
LIMIT 1
