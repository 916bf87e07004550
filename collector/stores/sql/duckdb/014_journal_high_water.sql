-- The highest journal record acknowledged when the last merge committed (collector/stores/journal.py,
-- issue 45): a journal found at the next start to end before it, or without its files, lost
-- acknowledged batches, and the collector says which instead of saying nothing.
ALTER TABLE journal_state ADD COLUMN journaled_seq BIGINT DEFAULT 0;
UPDATE journal_state SET journaled_seq = merged_seq;
