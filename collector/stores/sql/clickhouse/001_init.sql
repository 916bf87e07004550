-- tokentrace store, ClickHouse dialect (server over HTTP, or chdb in-process). Same tables, column
-- names, order and nullability as sql/duckdb/001_init.sql (normalize.TABLES), so that the normalizer
-- and every named query's result stay backend-neutral; the types map VARCHAR -> String,
-- BIGINT -> Int64, INTEGER -> Int32, DOUBLE -> Float64, BOOLEAN -> Bool, VARCHAR[] -> Array.
--
-- Every statement is idempotent (IF NOT EXISTS): several collectors may start against one server
-- at once and all run the migrations.
--
-- Layout, chosen for the analyzers' lookups (docs/scale-out.md):
--   * PARTITION BY the UTC day of the row's time: retention (--retention) drops whole days, and a
--     time window prunes partitions before it reads an index.
--   * ORDER BY (instance_id, time) for what is read per instance over a window (requests, phases,
--     steps, heartbeats, cache events); ORDER BY request_id for rows read one request at a time
--     (decode_steps, segments); ORDER BY hash for prefix_blocks, whose hot query is "which earlier
--     request had these block hashes". A bloom_filter skip index covers the other lookup key.
--   * LowCardinality for names with few distinct values (instances, span names, enums).
--   * allow_nullable_key: ids are nullable in the contract (a foreign sender may omit them).
--   * non_replicated_deduplication_window: spool files are inserted with a deduplication token
--     per table, so re-ingesting a file after a crash stores nothing twice (store_clickhouse.py).

CREATE TABLE IF NOT EXISTS spans (
    trace_id        String,
    span_id         String,
    parent_span_id  Nullable(String),
    name            LowCardinality(String),
    kind            Int32,
    start_ns        Int64,
    end_ns          Int64,
    status_code     Int32,
    status_message  Nullable(String),
    service_name    LowCardinality(Nullable(String)),
    instance_id     LowCardinality(Nullable(String)),
    scope_name      LowCardinality(Nullable(String)),
    request_id      Nullable(String),
    attributes      Nullable(String) CODEC(ZSTD(1)),
    events          Nullable(String) CODEC(ZSTD(1)),
    links           Nullable(String) CODEC(ZSTD(1)),
    resource        Nullable(String) CODEC(ZSTD(1)),
    INDEX request_id_bf request_id TYPE bloom_filter GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(start_ns, 'UTC'))
ORDER BY (trace_id, start_ns)
SETTINGS allow_nullable_key = 1, non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS resources (
    instance_id     LowCardinality(Nullable(String)),
    service_name    LowCardinality(Nullable(String)),
    host_name       LowCardinality(Nullable(String)),
    engine          LowCardinality(Nullable(String)),
    engine_version  LowCardinality(Nullable(String)),
    model           LowCardinality(Nullable(String)),
    seen_ns         Int64,
    attributes      Nullable(String) CODEC(ZSTD(1))
) ENGINE = MergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(seen_ns, 'UTC'))
ORDER BY (instance_id, seen_ns)
SETTINGS allow_nullable_key = 1, non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS requests (
    request_id          String,
    trace_id            String,
    span_id             String,
    instance_id         LowCardinality(Nullable(String)),
    service_name        LowCardinality(Nullable(String)),
    engine              LowCardinality(Nullable(String)),
    model               LowCardinality(Nullable(String)),
    session_id          Nullable(String),
    endpoint            LowCardinality(Nullable(String)),
    start_ns            Int64 CODEC(Delta, ZSTD(1)),
    end_ns              Int64,
    queue_ms            Nullable(Float64),
    load_wait_ms        Nullable(Float64),
    prefill_ms          Nullable(Float64),
    decode_ms           Nullable(Float64),
    ttft_ms             Nullable(Float64),
    tpot_ms             Nullable(Float64),
    prompt_tokens       Nullable(Int64),
    cached_tokens       Nullable(Int64),
    completion_tokens   Nullable(Int64),
    max_tokens          Nullable(Int64),
    finish_reason       LowCardinality(Nullable(String)),
    streamed            Nullable(Bool),
    client_disconnected Nullable(Bool),
    http_status         Nullable(Int64),
    error_type          LowCardinality(Nullable(String)),
    INDEX request_id_bf request_id TYPE bloom_filter GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(start_ns, 'UTC'))
ORDER BY (instance_id, start_ns)
SETTINGS allow_nullable_key = 1, non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS phases (
    request_id      Nullable(String),
    instance_id     LowCardinality(Nullable(String)),
    trace_id        String,
    span_id         String,
    parent_span_id  Nullable(String),
    name            LowCardinality(String),
    start_ns        Int64 CODEC(Delta, ZSTD(1)),
    end_ns          Int64,
    queue_depth     Nullable(Int64),
    queue_running   Nullable(Int64),
    max_batch       Nullable(Int64),
    load_id         Nullable(String),
    INDEX request_id_bf request_id TYPE bloom_filter GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(start_ns, 'UTC'))
ORDER BY (instance_id, start_ns)
SETTINGS allow_nullable_key = 1, non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS prefill_chunks (
    request_id      Nullable(String),
    instance_id     LowCardinality(Nullable(String)),
    start_ns        Int64 CODEC(Delta, ZSTD(1)),
    end_ns          Int64,
    chunk_offset    Nullable(Int64),
    tokens          Nullable(Int64),
    batch_size      Nullable(Int64),
    INDEX request_id_bf request_id TYPE bloom_filter GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(start_ns, 'UTC'))
ORDER BY (instance_id, start_ns)
SETTINGS allow_nullable_key = 1, non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS decode_steps (
    request_id      Nullable(String),
    instance_id     LowCardinality(Nullable(String)),
    step            Int64,
    t_ns            Int64 CODEC(Delta, ZSTD(1))
) ENGINE = MergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(t_ns, 'UTC'))
ORDER BY (request_id, step)
SETTINGS allow_nullable_key = 1, non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS steps (
    instance_id         LowCardinality(Nullable(String)),
    start_ns            Int64 CODEC(Delta, ZSTD(1)),
    duration_ns         Nullable(Int64),
    prefill_seqs        Nullable(Int64),
    decode_seqs         Nullable(Int64),
    prefill_tokens      Nullable(Int64),
    decode_tokens       Nullable(Int64),
    prefill_request_ids Array(Nullable(String)),
    decode_request_ids  Array(Nullable(String))
) ENGINE = MergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(start_ns, 'UTC'))
ORDER BY (instance_id, start_ns)
SETTINGS allow_nullable_key = 1, non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS cache_lookups (
    request_id      Nullable(String),
    instance_id     LowCardinality(Nullable(String)),
    start_ns        Int64 CODEC(Delta, ZSTD(1)),
    end_ns          Int64,
    prompt_tokens   Nullable(Int64),
    matched_tokens  Nullable(Int64),
    match           LowCardinality(Nullable(String)),
    matched_entry   Nullable(Int64),
    cache_entries   Nullable(Int64),
    cache_bytes     Nullable(Int64),
    block_size      Nullable(Int64),
    INDEX request_id_bf request_id TYPE bloom_filter GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(start_ns, 'UTC'))
ORDER BY (instance_id, start_ns)
SETTINGS allow_nullable_key = 1, non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

-- The largest table (one row per 16 tokens of every prompt and stored entry). Ordered by hash, so
-- that "which earlier prompt or entry had these hashes" reads a few granules; the other columns then
-- arrive in hash order and compress less (ZSTD: ~16 bytes a row, against ~4 ordered by request).
-- A projection keeps a second copy ordered by request for a request's own blocks (lookup_blocks):
-- +4 bytes a row, and that lookup reads a few granules instead of every bloom-filter hit (measured
-- 3.5 ms against 30 ms on 12.7M rows; docs/scale-out.md).
CREATE TABLE IF NOT EXISTS prefix_blocks (
    request_id      Nullable(String) CODEC(ZSTD(3)),
    instance_id     LowCardinality(Nullable(String)),
    t_ns            Int64 CODEC(ZSTD(3)),
    source          LowCardinality(String),
    block_index     Int64 CODEC(T64, ZSTD(1)),
    hash            Int64 CODEC(ZSTD(1)),
    fingerprint     Nullable(Int64) CODEC(ZSTD(3)),
    PROJECTION by_request (SELECT * ORDER BY request_id, source, block_index)
) ENGINE = MergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(t_ns, 'UTC'))
ORDER BY (hash, t_ns)
SETTINGS allow_nullable_key = 1, non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS segments (
    request_id      Nullable(String),
    instance_id     LowCardinality(Nullable(String)),
    t_ns            Int64,
    segment_index   Int64,
    role            LowCardinality(Nullable(String)),
    token_start     Nullable(Int64),
    token_end       Nullable(Int64),
    hash            Nullable(Int64),
    snippet         Nullable(String),
    INDEX hash_bf hash TYPE bloom_filter GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(t_ns, 'UTC'))
ORDER BY (request_id, t_ns, segment_index)
SETTINGS allow_nullable_key = 1, non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS cache_inserts (
    request_id      Nullable(String),
    instance_id     LowCardinality(Nullable(String)),
    start_ns        Int64 CODEC(Delta, ZSTD(1)),
    end_ns          Int64,
    fingerprint     Nullable(Int64),
    tokens          Nullable(Int64),
    bytes           Nullable(Int64),
    block_size      Nullable(Int64),
    cache_entries   Nullable(Int64),
    cache_bytes     Nullable(Int64),
    max_entries     Nullable(Int64),
    max_bytes       Nullable(Int64),
    INDEX request_id_bf request_id TYPE bloom_filter GRANULARITY 1,
    INDEX fingerprint_bf fingerprint TYPE bloom_filter GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(start_ns, 'UTC'))
ORDER BY (instance_id, start_ns)
SETTINGS allow_nullable_key = 1, non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS cache_evictions (
    instance_id             LowCardinality(Nullable(String)),
    t_ns                    Int64 CODEC(Delta, ZSTD(1)),
    fingerprint             Nullable(Int64),
    tokens                  Nullable(Int64),
    bytes                   Nullable(Int64),
    reason                  LowCardinality(Nullable(String)),
    entry_request_id        Nullable(String),
    evicted_by_request_id   Nullable(String),
    cache_entries           Nullable(Int64),
    cache_bytes             Nullable(Int64),
    span_id                 Nullable(String),
    INDEX fingerprint_bf fingerprint TYPE bloom_filter GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(t_ns, 'UTC'))
ORDER BY (instance_id, t_ns)
SETTINGS allow_nullable_key = 1, non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS instance_events (
    instance_id     LowCardinality(Nullable(String)),
    service_name    LowCardinality(Nullable(String)),
    t_ns            Int64,
    event           LowCardinality(String),
    load_id         Nullable(String),
    span_name       LowCardinality(Nullable(String))
) ENGINE = MergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(t_ns, 'UTC'))
ORDER BY (instance_id, t_ns)
SETTINGS allow_nullable_key = 1, non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS model_loads (
    load_id         String,
    instance_id     LowCardinality(Nullable(String)),
    trace_id        String,
    span_id         String,
    start_ns        Int64,
    end_ns          Int64,
    lazy            Nullable(Bool),
    model_path      Nullable(String)
) ENGINE = MergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(start_ns, 'UTC'))
ORDER BY (instance_id, start_ns)
SETTINGS allow_nullable_key = 1, non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS load_stages (
    load_id         Nullable(String),
    instance_id     LowCardinality(Nullable(String)),
    trace_id        String,
    span_id         String,
    parent_span_id  Nullable(String),
    name            LowCardinality(String),
    start_ns        Int64,
    end_ns          Int64,
    bytes           Nullable(Int64)
) ENGINE = MergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(start_ns, 'UTC'))
ORDER BY (instance_id, start_ns)
SETTINGS allow_nullable_key = 1, non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS heartbeats (
    instance_id         LowCardinality(Nullable(String)),
    t_ns                Int64 CODEC(Delta, ZSTD(1)),
    queue_depth         Nullable(Int64),
    running             Nullable(Int64),
    max_batch           Nullable(Int64),
    cache_entries       Nullable(Int64),
    cache_bytes         Nullable(Int64),
    cache_max_entries   Nullable(Int64),
    cache_max_bytes     Nullable(Int64),
    kv_bytes_per_token  Nullable(Int64),
    memory_bytes        Nullable(Int64)
) ENGINE = MergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(t_ns, 'UTC'))
ORDER BY (instance_id, t_ns)
SETTINGS allow_nullable_key = 1, non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

-- Spool files already ingested. Inserted after all of the file's rows (store_clickhouse.py); no TTL,
-- so a file dropped again long after ingest is still recognised.
CREATE TABLE IF NOT EXISTS spool_files (
    sha256          String,
    name            String,
    spans           Int64,
    ingested_ns     Int64
) ENGINE = MergeTree
ORDER BY sha256;

-- Retention set with --retention, so that a collector changes the TTL only when it differs.
CREATE TABLE IF NOT EXISTS store_settings (
    name            String,
    value           String,
    set_ns          Int64
) ENGINE = MergeTree
ORDER BY (name, set_ns);
