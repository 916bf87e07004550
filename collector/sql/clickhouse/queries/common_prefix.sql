-- For each given request, the deepest block its prompt or stored entry shares with a prompt.
SELECT request_id, max(block_index) AS last_block
FROM prefix_blocks
WHERE request_id IN {request_ids:Array(String)}
  AND hash IN {hashes:Array(Int64)}
GROUP BY request_id
