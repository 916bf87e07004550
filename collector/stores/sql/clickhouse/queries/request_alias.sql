-- The request ids whose upstream named its answer request_id (the response body's id: llama.cpp's
-- chatcmpl-..., vLLM's, mlx_lm.server's), as the gateway recorded it (upstream_evidence's
-- "upstream.response_id", docs/gateway.md): an alias every lookup of a request accepts. Read only
-- when no request has that id; the substring test spares parsing every row's JSON.
SELECT DISTINCT request_id
FROM requests
WHERE position(upstream_evidence, {request_id:Nullable(String)}) > 0
  AND JSONExtractString(upstream_evidence, 'upstream.response_id') = {request_id:Nullable(String)}
ORDER BY request_id
