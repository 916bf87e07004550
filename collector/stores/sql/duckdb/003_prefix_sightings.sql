-- Cache verdicts ask, for each chained block hash of a prompt: was it seen before the lookup, and
-- was it cached on this instance or another? A shared system prompt puts the same hash in
-- thousands of prefix_blocks rows; fetching them all made a verdict cost 100-300 ms on 20M rows,
-- and an index over all of prefix_blocks.hash doubled the bytes per span.
--
-- prefix_sightings keeps the first appearance of each (hash, instance, source): who first had a
-- block, and when an instance first stored it, is all a verdict asks. The writer appends the first
-- row of each key it has not recorded lately (store_duckdb.RecentKeys, expand/prefix_sightings.sql),
-- so a popular prefix costs a row per instance and source, not one per request. Lookups use an IN
-- list of values (store_duckdb.bind_lists): DuckDB's planner takes the ART index only for that.
CREATE TABLE prefix_sightings (
    hash            BIGINT NOT NULL,
    block_index     BIGINT NOT NULL,
    t_ns            BIGINT NOT NULL,
    request_id      VARCHAR,
    instance_id     VARCHAR,
    source          VARCHAR NOT NULL,      -- 'lookup' or 'insert'
    fingerprint     BIGINT                 -- the entry's, for 'insert'
);

INSERT INTO prefix_sightings
SELECT hash, arg_min(block_index, t_ns), min(t_ns), arg_min(request_id, t_ns), instance_id, source,
       arg_min(fingerprint, t_ns)
FROM prefix_blocks
GROUP BY hash, instance_id, source;

CREATE INDEX prefix_sightings_hash ON prefix_sightings (hash);
