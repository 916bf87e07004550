-- The gateway (docs/gateway.md). Who observed each request row, and every routing decision.
--
-- requests.observer: engine (a tokentrace engine), plugin (the vLLM plugin), native (vLLM's own
-- llm_request span), gateway (seen from outside). A request is one row whoever observed it: the
-- gateway sends no llm.request for upstreams that report themselves; the two views join on
-- request_id (requests + routes).
ALTER TABLE requests ADD COLUMN observer VARCHAR;

-- One row per gateway.route span: the candidates, their scores, the choice, and the prompt tokens
-- another upstream held that the chosen one recomputed (avoidable prefill).
CREATE TABLE routes (
    request_id                VARCHAR,
    trace_id                  VARCHAR NOT NULL,
    span_id                   VARCHAR NOT NULL,
    instance_id               VARCHAR,         -- the upstream chosen (resource service.instance.id)
    session_id                VARCHAR,
    start_ns                  BIGINT NOT NULL, -- arrival at the gateway
    end_ns                    BIGINT NOT NULL, -- request sent upstream
    policy                    VARCHAR,
    reason                    VARCHAR,
    candidates                VARCHAR[],
    scores                    DOUBLE[],
    attempts                  BIGINT,
    skipped                   VARCHAR[],
    gateway_wait_ms           DOUBLE,
    avoidable_prefill_tokens  BIGINT,
    avoidable_from            VARCHAR
);
CREATE INDEX routes_request ON routes (request_id);
