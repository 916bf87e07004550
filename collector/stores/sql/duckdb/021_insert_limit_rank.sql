-- The rank whose bytes a distributed engine's prompt-cache byte limit counted, as each insert
-- declares it (tokentrace.cache.limit_rank; NULL where it declares none, or declares anything but an
-- integer of 0 or more): the cache verdict's binding node reads it from the evicting insert's row
-- instead of that request's whole trace (issue 46).
ALTER TABLE cache_inserts ADD COLUMN limit_rank BIGINT;

-- Rows stored before: filled from their llm.cache.insert span (same instance, start and end) where
-- it is in `span_rows`, the table every span of a small merge goes to (a collector taking a few
-- requests a second makes no span file). The spans of span files stay unread and their rows NULL:
-- this runs before the open checks the files and points the view `spans` at where they are now (a
-- moved store's view names paths that are gone), so reading the view here could fail the open.
UPDATE cache_inserts AS i SET limit_rank = declared.limit_rank
FROM (
    SELECT instance_id, start_ns, end_ns, min(limit_rank) AS limit_rank
    FROM (
        SELECT instance_id, start_ns, end_ns,
               CASE WHEN json_valid(attributes)
                         AND json_type(attributes, '$."tokentrace.cache.limit_rank"') = 'UBIGINT'
                    THEN TRY_CAST(json_extract_string(attributes, '$."tokentrace.cache.limit_rank"') AS BIGINT)
               END AS limit_rank
        FROM span_rows
        WHERE name = 'llm.cache.insert' AND contains(attributes, '"tokentrace.cache.limit_rank":')
    )
    WHERE limit_rank IS NOT NULL
    GROUP BY instance_id, start_ns, end_ns
    HAVING count(DISTINCT limit_rank) = 1
) AS declared
WHERE i.instance_id IS NOT DISTINCT FROM declared.instance_id AND i.start_ns = declared.start_ns
  AND i.end_ns = declared.end_ns;
