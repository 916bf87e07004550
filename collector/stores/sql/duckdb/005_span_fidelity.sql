-- What OTLP sends about a span beyond what 001 kept (issue 11 item 6): the W3C trace state, the
-- instrumentation scope's version, and how many attributes, events and links the sender dropped
-- (NULL when none). Link attributes and trace states ride in spans.links (JSON).
ALTER TABLE spans ADD COLUMN trace_state VARCHAR;
ALTER TABLE spans ADD COLUMN scope_version VARCHAR;
ALTER TABLE spans ADD COLUMN dropped_attributes_count BIGINT;
ALTER TABLE spans ADD COLUMN dropped_events_count BIGINT;
ALTER TABLE spans ADD COLUMN dropped_links_count BIGINT;
