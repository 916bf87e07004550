-- Stored spans per minute of end time, newest first: how much of the store the writer's memory
-- of span keys can hold at start (collector/stores/once.py).
SELECT intDiv(end_ns, 60000000000) AS minute, toInt64(count()) AS spans
FROM spans
GROUP BY minute
ORDER BY minute DESC
