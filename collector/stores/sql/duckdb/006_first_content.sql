-- Time to first *visible* token (issue 12): ms from arrival to the first response chunk that
-- carried answer text (tokentrace.request.first_content_ms). With a real detokenizer the first
-- generated token may yield no text yet, so this can be later than ttft_ms.
ALTER TABLE requests ADD COLUMN first_content_ms DOUBLE;
