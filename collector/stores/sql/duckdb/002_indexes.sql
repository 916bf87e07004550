-- Every verdict starts from one request row by id: a point lookup instead of a scan.
CREATE INDEX requests_request_id ON requests (request_id);
-- prefix_change looks for earlier prompts with a segment of equal content (one row per message).
CREATE INDEX segments_hash ON segments (hash);
