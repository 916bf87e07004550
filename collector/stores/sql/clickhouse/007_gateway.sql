-- The gateway (docs/gateway.md); twin of sql/duckdb/007_gateway.sql. Who observed each request
-- row, and every routing decision.
ALTER TABLE requests ADD COLUMN IF NOT EXISTS observer LowCardinality(Nullable(String));

CREATE TABLE IF NOT EXISTS routes (
    request_id                Nullable(String),
    trace_id                  String,
    span_id                   String,
    instance_id               LowCardinality(Nullable(String)),
    session_id                Nullable(String),
    start_ns                  Int64 CODEC(Delta, ZSTD(1)),
    end_ns                    Int64,
    policy                    LowCardinality(Nullable(String)),
    reason                    Nullable(String),
    candidates                Array(Nullable(String)),
    scores                    Array(Nullable(Float64)),
    attempts                  Nullable(Int64),
    skipped                   Array(Nullable(String)),
    gateway_wait_ms           Nullable(Float64),
    avoidable_prefill_tokens  Nullable(Int64),
    avoidable_from            LowCardinality(Nullable(String)),
    INDEX request_id_bf request_id TYPE bloom_filter GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(start_ns, 'UTC'))
ORDER BY (instance_id, start_ns)
SETTINGS allow_nullable_key = 1, non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;
