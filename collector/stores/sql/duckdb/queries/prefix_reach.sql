-- Per instance and source, the deepest block of a prompt (its chained hashes, in order) that an
-- earlier lookup or stored entry had before $before_ns, and the first row that had it: when, which
-- request, the entry's fingerprint. An equal hash at index i is an equal prefix of i + 1 blocks.
--
-- Candidates are the rows whose first new block (fresh_hash, 009_packed_lists.sql) is one of the
-- prompt's hashes: the first holder of any block the prompt shares with an earlier row is one of
-- them (collector/stores/frontier.py), so the index is probed once per prompt block for one key per row.
-- A list parameter written name[] binds one parameter per element (store_duckdb.bind_lists): DuckDB
-- takes the ART index for an IN list of values only, and only with nothing else filtering the same
-- scan, hence the MATERIALIZED CTE.
WITH candidates AS MATERIALIZED (
    SELECT request_id, instance_id, t_ns, source, fingerprint, hashes
    FROM prefix_block_lists
    WHERE fresh_hash IN ($hashes[])
), prompt AS (
    SELECT generate_subscripts($hashes::BIGINT[], 1) - 1 AS block_index, unnest($hashes::BIGINT[]) AS hash
), blocks AS (
    SELECT request_id, instance_id, t_ns, source, fingerprint,
           generate_subscripts(hashes, 1) - 1 AS block_index, unnest(hashes) AS hash
    FROM candidates
    WHERE t_ns < $before_ns
), reached AS (
    SELECT b.request_id, b.instance_id, b.t_ns, b.source, b.fingerprint, max(b.block_index) AS block_index
    FROM blocks b
    JOIN prompt p ON p.block_index = b.block_index AND p.hash = b.hash
    GROUP BY b.request_id, b.instance_id, b.t_ns, b.source, b.fingerprint
)
SELECT instance_id, source, block_index, t_ns, request_id, fingerprint
FROM reached
QUALIFY row_number() OVER (PARTITION BY instance_id, source
                           ORDER BY block_index DESC, t_ns, coalesce(request_id, '')) = 1
ORDER BY block_index DESC, instance_id, source
