-- Expand packed chained block hashes (normalize.PACKED) into one row per block; the blocks that can
-- be new (past what the request's lookup matched, 003_prefix_sightings.sql) also go to
-- prefix_sightings. An entry whose lookup is not in this batch has all its blocks recorded.
INSERT INTO prefix_blocks
SELECT request_id, instance_id, t_ns, source, generate_subscripts(hashes, 1) - 1, unnest(hashes), fingerprint
FROM staged;

INSERT INTO prefix_sightings
SELECT hash, block_index, t_ns, request_id, instance_id, source, fingerprint
FROM (
    SELECT s.request_id, s.instance_id, s.t_ns, s.source, s.fingerprint,
           coalesce(s.known, l.known, 0) AS known,
           generate_subscripts(s.hashes, 1) - 1 AS block_index, unnest(s.hashes) AS hash
    FROM staged s
    LEFT JOIN (SELECT request_id, max(known) AS known FROM staged WHERE source = 'lookup' GROUP BY request_id) l
           ON s.source = 'insert' AND l.request_id = s.request_id
)
WHERE block_index >= known;
