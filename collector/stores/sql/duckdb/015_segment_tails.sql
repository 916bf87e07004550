-- Each segment's tail hash (its last block of tokens; null under two blocks): a message edited at
-- its start (a timestamp in front of a system prompt) shares no prefix block and no content hash
-- with the one it was edited from, only its tail (issue 44). Indexed like `hash`: the cache
-- verdict asks which earlier segments had this tail.
ALTER TABLE segments ADD COLUMN tail_hash BIGINT;
CREATE INDEX segments_tail_hash ON segments (tail_hash);
