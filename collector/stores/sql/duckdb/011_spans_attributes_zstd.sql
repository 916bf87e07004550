-- spans.attributes compressed with zstd instead of the dictionary + FSST compression DuckDB picks
-- for it (issue 17). Engine spans' attribute objects are long and seldom repeat whole, so a
-- dictionary gains little, and compressing them that way was a fifth of what appending a span to
-- this table cost: appending 414k engine spans took 2.18 instead of 1.68 us of CPU a span,
-- and the table took 96 instead of 69 bytes a span (docs/benchmarks.md, Issue 17, seventh round).
-- DuckDB sets a column's compression only when its table is created: a store written before is
-- rebuilt here once when a collector opens it (3.9 s for 1.38M engine spans), and needs room for
-- the table twice meanwhile; the old table's blocks are then reused by later writes.
CREATE TABLE spans_zstd (
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
    attributes      VARCHAR USING COMPRESSION zstd,  -- JSON object
    events          VARCHAR,               -- JSON array of {name, time_ns, attributes}
    links           VARCHAR,               -- JSON array of {trace_id, span_id}
    resource        VARCHAR,               -- JSON object of resource attributes
    trace_state     VARCHAR,
    scope_version   VARCHAR,
    dropped_attributes_count BIGINT,
    dropped_events_count     BIGINT,
    dropped_links_count      BIGINT
);
INSERT INTO spans_zstd SELECT * FROM spans;
DROP TABLE spans;
ALTER TABLE spans_zstd RENAME TO spans;
