-- A whole-file checksum of each span file (issue 45; collector/stores/span_files.py): the CRC-32 of
-- every byte of the file, computed by one read of the file once it is synced (a merge's file, a
-- compaction's joined or rewritten one) and verified wherever its pages are (a collector's open,
-- `tokentrace store check|repair`). Each page's own CRC-32 covers its data only: a flipped byte in
-- a page header's or the footer's statistics or metadata strings passed it. NULL for the files
-- listed before this migration: those are checked as before (every page's checksum), until a
-- compaction joins them into a file that has one.
ALTER TABLE span_files ADD COLUMN crc32 BIGINT;
