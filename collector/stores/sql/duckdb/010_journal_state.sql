-- The write-ahead journal (collector/stores/journal.py, issue 17): acknowledged batches are appended to a
-- log beside the store file and merged into the tables later; the merge that appends a batch's rows
-- records its sequence number here in the same transaction, so that after a crash exactly the
-- records after it are appended again.
CREATE TABLE journal_state (
    merged_seq      BIGINT NOT NULL        -- the last journal record whose rows are in the tables
);
INSERT INTO journal_state VALUES (0);
