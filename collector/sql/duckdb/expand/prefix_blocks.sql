-- Expand packed chained block hashes (normalize.PACKED) into one row per block.
INSERT INTO prefix_blocks
SELECT request_id, instance_id, t_ns, source, generate_subscripts(hashes, 1) - 1, unnest(hashes), fingerprint
FROM staged
