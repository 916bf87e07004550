-- Per-token and per-block rows stored packed, one row per span (issue 17). An engine span wrote 25
-- DuckDB rows, 15 of them prefix_blocks and 8 decode_steps, and prefix_sightings indexed ~20 new
-- block hashes per span: at 100k spans/s that alone was more than the machine could append. The
-- lists are what the spans carried; the views prefix_blocks and decode_steps give the rows they
-- expand to, with the columns those tables had, for every query written against them.
--
-- prefix_block_lists: the chained block hashes of each lookup and stored entry. fresh_from is the
-- first block index no earlier row of the same instance and source had (NULL: none new), and
-- fresh_hash the hash there. Chained hashes make a prompt's new blocks a suffix: so the rows that
-- first had any block of a later prompt are among those whose fresh_hash is one of that prompt's
-- hashes, an index of one key per row instead of one per new block (queries/prefix_reach.sql).
CREATE TABLE prefix_block_lists (
    request_id      VARCHAR,
    instance_id     VARCHAR,
    t_ns            BIGINT NOT NULL,
    source          VARCHAR NOT NULL,      -- 'lookup' or 'insert'
    fingerprint     BIGINT,                -- the entry's, for 'insert'
    hashes          BIGINT[] NOT NULL,     -- block i at list index i
    fresh_from      INTEGER,
    fresh_hash      BIGINT
);

-- A store written before: each row's first new block is its lowest block that prefix_sightings
-- recorded as a first appearance.
INSERT INTO prefix_block_lists
WITH firsts AS (
    SELECT b.request_id, b.instance_id, b.t_ns, b.source, min(b.block_index) AS fresh_from
    FROM prefix_blocks b
    JOIN prefix_sightings s
      ON s.hash = b.hash AND s.block_index = b.block_index AND s.t_ns = b.t_ns AND s.source = b.source
     AND s.instance_id IS NOT DISTINCT FROM b.instance_id AND s.request_id IS NOT DISTINCT FROM b.request_id
    GROUP BY ALL
), lists AS (
    SELECT request_id, instance_id, t_ns, source, fingerprint, list(hash ORDER BY block_index) AS hashes
    FROM prefix_blocks
    GROUP BY ALL
)
SELECT l.request_id, l.instance_id, l.t_ns, l.source, l.fingerprint, l.hashes, f.fresh_from,
       CASE WHEN f.fresh_from IS NOT NULL THEN l.hashes[f.fresh_from + 1] END
FROM lists l
LEFT JOIN firsts f
  ON f.t_ns = l.t_ns AND f.source = l.source AND f.instance_id IS NOT DISTINCT FROM l.instance_id
 AND f.request_id IS NOT DISTINCT FROM l.request_id;

DROP TABLE prefix_sightings;
DROP TABLE prefix_blocks;
CREATE INDEX prefix_block_lists_fresh ON prefix_block_lists (fresh_hash);
CREATE VIEW prefix_blocks AS
SELECT request_id, instance_id, t_ns, source, generate_subscripts(hashes, 1) - 1 AS block_index,
       unnest(hashes) AS hash, fingerprint
FROM prefix_block_lists;

-- decode_step_lists: one llm.decode's token times as offsets from the first (start_ns). A store
-- written before is regrouped by request and instance, a new run at each step 0 (a request id a
-- client reused).
CREATE TABLE decode_step_lists (
    request_id      VARCHAR,
    instance_id     VARCHAR,
    start_ns        BIGINT NOT NULL,
    offsets         BIGINT[] NOT NULL       -- token i at start_ns + offsets[i]
);

INSERT INTO decode_step_lists
WITH runs AS (
    SELECT request_id, instance_id, step, t_ns,
           sum(CASE WHEN step = 0 THEN 1 ELSE 0 END) OVER (
               PARTITION BY request_id, instance_id ORDER BY t_ns, step ROWS UNBOUNDED PRECEDING) AS run
    FROM decode_steps
), started AS (
    SELECT *, min(t_ns) OVER (PARTITION BY request_id, instance_id, run) AS start_ns FROM runs
)
SELECT request_id, instance_id, start_ns, list(t_ns - start_ns ORDER BY step)
FROM started
GROUP BY request_id, instance_id, run, start_ns;

DROP TABLE decode_steps;
CREATE VIEW decode_steps AS
SELECT request_id, instance_id, generate_subscripts(offsets, 1) - 1 AS step, start_ns + unnest(offsets) AS t_ns
FROM decode_step_lists;
