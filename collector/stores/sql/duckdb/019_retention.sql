-- Retention of a DuckDB store (--retention; collector/stores/retention.py, issue 45): the retention
-- the store keeps (seconds; 0 keeps everything), remembered across starts as a ClickHouse store's
-- TTL is, and its last pass: every row, span and span file that started before floor_ns is gone
-- (the view `spans` also hides the older spans of a file that straddles it).
CREATE TABLE retention (
    retention_s     BIGINT NOT NULL,
    floor_ns        BIGINT,                -- NULL: no pass yet
    pass_ns         BIGINT                 -- when the last pass committed
);
INSERT INTO retention VALUES (0, NULL, NULL);
