-- Stored spans of these traces that started at these times: the writer's exact check of spans it
-- cannot rule out from memory (collector/stores/once.py). The range of the start times lets the scan skip
-- row groups by their start_ns min/max; the two lists are joined, not expanded into IN lists of
-- constants, which DuckDB parsed and planned for every batch of late spans (32 against 7 ms a batch
-- of 460 new engine spans on a store of 460k; docs/benchmarks.md, Issue 17, tenth round).
SELECT trace_id, span_id, start_ns
FROM spans
WHERE start_ns BETWEEN list_min($starts) AND list_max($starts)
  AND start_ns IN (SELECT unnest($starts))
  AND trace_id IN (SELECT unnest($traces))
ORDER BY trace_id, span_id, start_ns
