-- Retention (--retention Nd): rows older than {days} days are dropped, whole daily parts at a time
-- (ttl_only_drop_parts), by the same time column each table is partitioned by. spool_files and
-- store_settings keep everything. Applied only when the stored setting differs (store_clickhouse.py).
ALTER TABLE spans MODIFY TTL toDateTime(intDiv(start_ns, 1000000000)) + toIntervalDay({days:UInt32});
ALTER TABLE resources MODIFY TTL toDateTime(intDiv(seen_ns, 1000000000)) + toIntervalDay({days:UInt32});
ALTER TABLE requests MODIFY TTL toDateTime(intDiv(start_ns, 1000000000)) + toIntervalDay({days:UInt32});
ALTER TABLE phases MODIFY TTL toDateTime(intDiv(start_ns, 1000000000)) + toIntervalDay({days:UInt32});
ALTER TABLE prefill_chunks MODIFY TTL toDateTime(intDiv(start_ns, 1000000000)) + toIntervalDay({days:UInt32});
ALTER TABLE decode_steps MODIFY TTL toDateTime(intDiv(t_ns, 1000000000)) + toIntervalDay({days:UInt32});
ALTER TABLE steps MODIFY TTL toDateTime(intDiv(start_ns, 1000000000)) + toIntervalDay({days:UInt32});
ALTER TABLE cache_lookups MODIFY TTL toDateTime(intDiv(start_ns, 1000000000)) + toIntervalDay({days:UInt32});
ALTER TABLE prefix_blocks MODIFY TTL toDateTime(intDiv(t_ns, 1000000000)) + toIntervalDay({days:UInt32});
ALTER TABLE segments MODIFY TTL toDateTime(intDiv(t_ns, 1000000000)) + toIntervalDay({days:UInt32});
ALTER TABLE cache_inserts MODIFY TTL toDateTime(intDiv(start_ns, 1000000000)) + toIntervalDay({days:UInt32});
ALTER TABLE cache_evictions MODIFY TTL toDateTime(intDiv(t_ns, 1000000000)) + toIntervalDay({days:UInt32});
ALTER TABLE instance_events MODIFY TTL toDateTime(intDiv(t_ns, 1000000000)) + toIntervalDay({days:UInt32});
ALTER TABLE model_loads MODIFY TTL toDateTime(intDiv(start_ns, 1000000000)) + toIntervalDay({days:UInt32});
ALTER TABLE load_stages MODIFY TTL toDateTime(intDiv(start_ns, 1000000000)) + toIntervalDay({days:UInt32});
ALTER TABLE heartbeats MODIFY TTL toDateTime(intDiv(t_ns, 1000000000)) + toIntervalDay({days:UInt32});
ALTER TABLE routes MODIFY TTL toDateTime(intDiv(start_ns, 1000000000)) + toIntervalDay({days:UInt32});
