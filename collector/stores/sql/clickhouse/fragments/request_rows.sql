-- One row per request, however many observers saw it (docs/analyzers.md "One request, several
-- observers"): the merge every named query over requests reads, defined here once. The query
-- around it defines `inside` (rows of observers inside the engine: a tokentrace engine, the vLLM
-- plugin, vLLM's own spans; observer not 'gateway') and `outside` (the gateway's rows), each over
-- the window it needs. A request both saw is the inside row with the gateway's outer bounds: it
-- starts at the gateway's arrival and ends with the last byte the client received (its end-to-end
-- is the client's); its queue is the engine's plus the gateway's admission wait (unknown when the
-- engine's is); its time to first token counts from the gateway's arrival; time to first content,
-- the HTTP status, streaming and a disconnect are what the client saw; a count or phase only one
-- of them knows is that one's. A request one observer saw is that observer's row.
request_rows AS (
    SELECT i.request_id, i.trace_id, i.span_id, i.instance_id, i.service_name, i.engine,
           coalesce(i.model, o.model) AS model, coalesce(i.session_id, o.session_id) AS session_id,
           coalesce(i.endpoint, o.endpoint) AS endpoint,
           least(i.start_ns, o.start_ns) AS start_ns, greatest(i.end_ns, o.end_ns) AS end_ns,
           i.queue_ms + coalesce(o.queue_ms, 0) AS queue_ms,
           coalesce(i.load_wait_ms, o.load_wait_ms) AS load_wait_ms,
           coalesce(i.prefill_ms, o.prefill_ms) AS prefill_ms, coalesce(i.decode_ms, o.decode_ms) AS decode_ms,
           coalesce(i.ttft_ms + (i.start_ns - least(i.start_ns, o.start_ns)) / 1e6, o.ttft_ms) AS ttft_ms,
           coalesce(i.tpot_ms, o.tpot_ms) AS tpot_ms,
           coalesce(i.prompt_tokens, o.prompt_tokens) AS prompt_tokens,
           coalesce(i.cached_tokens, o.cached_tokens) AS cached_tokens,
           coalesce(i.completion_tokens, o.completion_tokens) AS completion_tokens,
           coalesce(i.max_tokens, o.max_tokens) AS max_tokens,
           coalesce(i.finish_reason, o.finish_reason) AS finish_reason,
           coalesce(o.streamed, i.streamed) AS streamed,
           coalesce(o.client_disconnected, i.client_disconnected) AS client_disconnected,
           coalesce(o.http_status, i.http_status) AS http_status,
           coalesce(i.error_type, o.error_type) AS error_type,
           coalesce(o.first_content_ms, i.first_content_ms + (i.start_ns - least(i.start_ns, o.start_ns)) / 1e6)
               AS first_content_ms,
           i.observer, coalesce(i.upstream_evidence, o.upstream_evidence) AS upstream_evidence
    FROM inside i
    JOIN outside o ON o.request_id = i.request_id
    UNION ALL
    SELECT * FROM inside WHERE request_id NOT IN (SELECT request_id FROM outside)
    UNION ALL
    SELECT * FROM outside WHERE request_id NOT IN (SELECT request_id FROM inside)
)
