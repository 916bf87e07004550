-- --retention off: keep everything again. Only tables that have a TTL are altered (store_clickhouse.py).
ALTER TABLE spans REMOVE TTL;
ALTER TABLE resources REMOVE TTL;
ALTER TABLE requests REMOVE TTL;
ALTER TABLE phases REMOVE TTL;
ALTER TABLE prefill_chunks REMOVE TTL;
ALTER TABLE decode_steps REMOVE TTL;
ALTER TABLE steps REMOVE TTL;
ALTER TABLE cache_lookups REMOVE TTL;
ALTER TABLE prefix_blocks REMOVE TTL;
ALTER TABLE segments REMOVE TTL;
ALTER TABLE cache_inserts REMOVE TTL;
ALTER TABLE cache_evictions REMOVE TTL;
ALTER TABLE instance_events REMOVE TTL;
ALTER TABLE model_loads REMOVE TTL;
ALTER TABLE load_stages REMOVE TTL;
ALTER TABLE heartbeats REMOVE TTL;
