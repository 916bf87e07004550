-- Cache verdicts ask, for each chained block hash of a prompt: was it seen before the lookup, and
-- was it cached on this instance or another? A shared system prompt puts the same hash in
-- thousands of prefix_blocks rows; fetching them all made a verdict cost 100-300 ms on 20M rows,
-- and an index over all of prefix_blocks.hash doubled the bytes per span.
--
-- prefix_sightings keeps only the blocks that can be new where they appear: a lookup's blocks past
-- what it matched (the matched ones came from an entry stored earlier on this instance, so they
-- were recorded then), and an entry's blocks past what its request's lookup matched. The earliest
-- sighting of any hash, and the first time an instance stored it, are always among these rows.
-- Of those the writer appends only the first row of each (hash, instance, source) it has not
-- recorded lately: a popular prefix missed again and again would otherwise add a row each time.
-- Filled in the same transaction as prefix_blocks (expand/prefix_sightings.sql).
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
SELECT hash, block_index, t_ns, request_id, instance_id, source, fingerprint
FROM prefix_blocks;

CREATE INDEX prefix_sightings_hash ON prefix_sightings (hash);
