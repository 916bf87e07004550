-- The spans of large merges kept in Parquet files beside the store (issue 17; collector/stores/span_files.py).
-- Appending a row to DuckDB's `spans` cost the merge 4.7-5.4 us of CPU an engine span, writing the
-- same rows to a Parquet file 0.7 (docs/benchmarks.md, Issue 17, twenty-first round). The rows a
-- merge of few spans appends stay in `span_rows` (the table `spans` was); `span_files` lists the
-- files whose rows are stored, and the view `spans` reads both. A merge that writes a file lists it
-- and redefines the view in the transaction that appends its other rows, so a reader sees a file's
-- spans exactly when it sees the rest of its batches; a file no transaction listed (a crash between
-- the two) is deleted at the next open, and the journal appends its batches again.
ALTER TABLE spans RENAME TO span_rows;

CREATE TABLE span_files (
    name            VARCHAR NOT NULL,      -- the file's name in STORE.spans/
    level           INTEGER NOT NULL,      -- 0: written by a merge; n: n-fold compacted
    spans           BIGINT NOT NULL,
    min_start_ns    BIGINT NOT NULL,
    max_start_ns    BIGINT NOT NULL,
    bytes           BIGINT NOT NULL,
    written_ns      BIGINT NOT NULL
);

-- Redefined with the files' paths whenever a file is listed or compacted (span_files.py).
CREATE VIEW spans AS SELECT * FROM span_rows;
