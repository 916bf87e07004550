-- Cache verdicts look up earlier prompts and entries by chained block hash across all history
-- (no time window applies). Without an index that is a scan of every block row (64-77 ms on 20M
-- rows, measured); with an ART index, 2-5 ms. The index costs about 0.65 us per inserted row.
CREATE INDEX prefix_blocks_hash ON prefix_blocks (hash);
CREATE INDEX segments_hash ON segments (hash);
-- Every verdict starts from one request row by id: a point lookup instead of a scan.
CREATE INDEX requests_request_id ON requests (request_id);
