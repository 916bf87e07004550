-- tokentrace store, DuckDB dialect. Times are integer nanoseconds since the Unix epoch (OTLP's
-- own unit); ids are lower-case hex; hashes are signed 64-bit (docs/telemetry.md). JSON columns hold
-- JSON text. Column order matches tokentrace.collector.decoding.normalize.TABLES. Counts are BIGINT because
-- OTLP integers are int64: a sender's large value must never fail a whole group of writes.

-- Every span from every sender. Attributes expanded into typed tables (block hashes, decode step
-- offsets, engine-step arrays, segments) are not repeated here for contract spans.
CREATE TABLE spans (
    trace_id        VARCHAR NOT NULL,
    span_id         VARCHAR NOT NULL,
    parent_span_id  VARCHAR,
    name            VARCHAR NOT NULL,
    kind            INTEGER NOT NULL,      -- OTLP SpanKind number
    start_ns        BIGINT NOT NULL,
    end_ns          BIGINT NOT NULL,
    status_code     INTEGER NOT NULL,      -- OTLP StatusCode number
    status_message  VARCHAR,
    service_name    VARCHAR,
    instance_id     VARCHAR,               -- resource service.instance.id
    scope_name      VARCHAR,
    request_id      VARCHAR,               -- tokentrace.request.id, when the span has one
    attributes      VARCHAR,               -- JSON object
    events          VARCHAR,               -- JSON array of {name, time_ns, attributes}
    links           VARCHAR,               -- JSON array of {trace_id, span_id}
    resource        VARCHAR                -- JSON object of resource attributes
);

-- One row per ResourceSpans seen: which instances exist and when they last spoke.
CREATE TABLE resources (
    instance_id     VARCHAR,
    service_name    VARCHAR,
    host_name       VARCHAR,
    engine          VARCHAR,
    engine_version  VARCHAR,
    model           VARCHAR,
    seen_ns         BIGINT NOT NULL,       -- latest span end in that export
    attributes      VARCHAR                -- JSON object
);

-- One row per llm.request span: the phase summary, so that a request needs no join.
CREATE TABLE requests (
    request_id          VARCHAR NOT NULL,
    trace_id            VARCHAR NOT NULL,
    span_id             VARCHAR NOT NULL,
    instance_id         VARCHAR,
    service_name        VARCHAR,
    engine              VARCHAR,
    model               VARCHAR,
    session_id          VARCHAR,
    endpoint            VARCHAR,
    start_ns            BIGINT NOT NULL,
    end_ns              BIGINT NOT NULL,
    queue_ms            DOUBLE,
    load_wait_ms        DOUBLE,
    prefill_ms          DOUBLE,
    decode_ms           DOUBLE,
    ttft_ms             DOUBLE,
    tpot_ms             DOUBLE,
    prompt_tokens       BIGINT,
    cached_tokens       BIGINT,
    completion_tokens   BIGINT,
    max_tokens          BIGINT,
    finish_reason       VARCHAR,
    streamed            BOOLEAN,
    client_disconnected BOOLEAN,
    http_status         BIGINT,
    error_type          VARCHAR
);

-- Phase spans of a request: llm.queue, llm.load_wait, llm.cache.lookup, llm.prefill, llm.decode,
-- llm.cache.insert.
CREATE TABLE phases (
    request_id      VARCHAR,
    instance_id     VARCHAR,
    trace_id        VARCHAR NOT NULL,
    span_id         VARCHAR NOT NULL,
    parent_span_id  VARCHAR,
    name            VARCHAR NOT NULL,
    start_ns        BIGINT NOT NULL,
    end_ns          BIGINT NOT NULL,
    queue_depth     BIGINT,               -- llm.queue: requests waiting at enqueue
    queue_running   BIGINT,               -- llm.queue: sequences running at enqueue
    max_batch       BIGINT,               -- llm.queue: concurrent sequences admitted
    load_id         VARCHAR                -- llm.load_wait: the model.load waited on
);

CREATE TABLE prefill_chunks (
    request_id      VARCHAR,
    instance_id     VARCHAR,
    start_ns        BIGINT NOT NULL,
    end_ns          BIGINT NOT NULL,
    chunk_offset    BIGINT,               -- prompt index of the chunk's first token
    tokens          BIGINT,
    batch_size      BIGINT
);

-- llm.decode's step offsets, one row per generated token (step 0 is the first token).
CREATE TABLE decode_steps (
    request_id      VARCHAR,
    instance_id     VARCHAR,
    step            BIGINT NOT NULL,
    t_ns            BIGINT NOT NULL        -- when the token was produced
);

-- engine.steps windows, one row per engine step.
CREATE TABLE steps (
    instance_id         VARCHAR,
    start_ns            BIGINT NOT NULL,
    duration_ns         BIGINT,
    prefill_seqs        BIGINT,
    decode_seqs         BIGINT,
    prefill_tokens      BIGINT,
    decode_tokens       BIGINT,
    prefill_request_ids VARCHAR[],
    decode_request_ids  VARCHAR[]
);

CREATE TABLE cache_lookups (
    request_id      VARCHAR,
    instance_id     VARCHAR,
    start_ns        BIGINT NOT NULL,
    end_ns          BIGINT NOT NULL,
    prompt_tokens   BIGINT,
    matched_tokens  BIGINT,
    match           VARCHAR,               -- exact | prefix | none
    matched_entry   BIGINT,                -- fingerprint of the entry reused
    cache_entries   BIGINT,
    cache_bytes     BIGINT,
    block_size      BIGINT
);

-- Chained block hashes: of each looked-up prompt (source 'lookup') and each stored entry
-- (source 'insert', with the entry's fingerprint).
CREATE TABLE prefix_blocks (
    request_id      VARCHAR,
    instance_id     VARCHAR,
    t_ns            BIGINT NOT NULL,
    source          VARCHAR NOT NULL,
    block_index     BIGINT NOT NULL,
    hash            BIGINT NOT NULL,
    fingerprint     BIGINT
);

CREATE TABLE segments (
    request_id      VARCHAR,
    instance_id     VARCHAR,
    t_ns            BIGINT NOT NULL,
    segment_index   BIGINT NOT NULL,
    role            VARCHAR,
    token_start     BIGINT,
    token_end       BIGINT,
    hash            BIGINT,
    snippet         VARCHAR                -- only with --capture-content
);

CREATE TABLE cache_inserts (
    request_id      VARCHAR,
    instance_id     VARCHAR,
    start_ns        BIGINT NOT NULL,
    end_ns          BIGINT NOT NULL,
    fingerprint     BIGINT,
    tokens          BIGINT,
    bytes           BIGINT,
    block_size      BIGINT,
    cache_entries   BIGINT,               -- after the insert and its evictions
    cache_bytes     BIGINT,
    max_entries     BIGINT,
    max_bytes       BIGINT
);

CREATE TABLE cache_evictions (
    instance_id             VARCHAR,
    t_ns                    BIGINT NOT NULL,
    fingerprint             BIGINT,
    tokens                  BIGINT,
    bytes                   BIGINT,
    reason                  VARCHAR,
    entry_request_id        VARCHAR,       -- request whose tokens the entry held
    evicted_by_request_id   VARCHAR,       -- request whose insert pushed it out, if any
    cache_entries           BIGINT,
    cache_bytes             BIGINT,
    span_id                 VARCHAR        -- the span that carried the event
);

CREATE TABLE instance_events (
    instance_id     VARCHAR,
    service_name    VARCHAR,
    t_ns            BIGINT NOT NULL,
    event           VARCHAR NOT NULL,
    load_id         VARCHAR,
    span_name       VARCHAR
);

CREATE TABLE model_loads (
    load_id         VARCHAR NOT NULL,
    instance_id     VARCHAR,
    trace_id        VARCHAR NOT NULL,
    span_id         VARCHAR NOT NULL,
    start_ns        BIGINT NOT NULL,
    end_ns          BIGINT NOT NULL,
    lazy            BOOLEAN,
    model_path      VARCHAR
);

CREATE TABLE load_stages (
    load_id         VARCHAR,
    instance_id     VARCHAR,
    trace_id        VARCHAR NOT NULL,
    span_id         VARCHAR NOT NULL,
    parent_span_id  VARCHAR,
    name            VARCHAR NOT NULL,
    start_ns        BIGINT NOT NULL,
    end_ns          BIGINT NOT NULL,
    bytes           BIGINT
);

CREATE TABLE heartbeats (
    instance_id         VARCHAR,
    t_ns                BIGINT NOT NULL,
    queue_depth         BIGINT,
    running             BIGINT,
    max_batch           BIGINT,
    cache_entries       BIGINT,
    cache_bytes         BIGINT,
    cache_max_entries   BIGINT,
    cache_max_bytes     BIGINT,
    kv_bytes_per_token  BIGINT,
    memory_bytes        BIGINT
);

-- Spool files already ingested, recorded in the same transaction as their rows: exactly once.
CREATE TABLE spool_files (
    sha256          VARCHAR PRIMARY KEY,
    name            VARCHAR NOT NULL,
    spans           BIGINT NOT NULL,
    ingested_ns     BIGINT NOT NULL
);
