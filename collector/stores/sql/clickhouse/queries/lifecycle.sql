-- Every lifecycle event (instance.started, instance.ready, instance.first_response, instance.stopped),
-- by instance then time.
SELECT instance_id, t_ns, event, load_id, span_name
FROM instance_events
ORDER BY instance_id, t_ns
