-- One request's row. Should two observers have sent one (e.g. a gateway that did not know its
-- upstream reports itself), the inside view wins: engine or plugin, then vLLM's native span, then
-- the gateway; among equals the latest (a sender's resend).
SELECT *
FROM requests
WHERE request_id = $request_id
ORDER BY CASE observer WHEN 'gateway' THEN 2 WHEN 'native' THEN 1 ELSE 0 END, end_ns DESC
LIMIT 1
