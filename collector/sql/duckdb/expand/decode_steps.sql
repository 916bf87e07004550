-- Expand packed llm.decode offsets (normalize.PACKED) into one row per generated token.
INSERT INTO decode_steps
SELECT request_id, instance_id, generate_subscripts(offsets, 1) - 1, start_ns + unnest(offsets)
FROM staged
