-- For each given request, the deepest block its prompt or stored entry shares with a prompt.
SELECT request_id, max(block_index) AS last_block
FROM prefix_blocks
WHERE request_id IN (SELECT unnest($request_ids::VARCHAR[]))
  AND hash IN (SELECT unnest($hashes::BIGINT[]))
GROUP BY request_id
