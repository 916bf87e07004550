-- Every instance seen, with its latest resource attributes and when it last spoke.
SELECT instance_id, arg_max(service_name, seen_ns) AS service_name, arg_max(host_name, seen_ns) AS host_name,
       arg_max(engine, seen_ns) AS engine, arg_max(engine_version, seen_ns) AS engine_version,
       arg_max(model, seen_ns) AS model, min(seen_ns) AS first_seen_ns, max(seen_ns) AS last_seen_ns
FROM resources
WHERE instance_id IS NOT NULL
GROUP BY instance_id
ORDER BY instance_id
