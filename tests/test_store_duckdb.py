"""DuckDB store internals that keep verdicts fast: list parameters and the sightings filter.

Whether DuckDB takes the ART index for an IN list shows in time, not in EXPLAIN (the index is used
inside the scan at run time): bench/analyze.py is where a regression would show (docs/benchmarks.md).
"""

from __future__ import annotations

import golden
import numpy as np
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace.collector.normalize import normalize
from tokentrace.collector.store_duckdb import DuckDBStore, RecentKeys, bind_lists


def test_list_parameters_become_one_bound_value_each():
    sql, params = bind_lists("SELECT 1 WHERE h IN ($hashes[]) AND t < $t -- $hashes[] again", {"hashes": [5, 6],
                                                                                               "t": 9})
    assert sql == "SELECT 1 WHERE h IN ($hashes_0, $hashes_1) AND t < $t -- $hashes_0, $hashes_1 again"
    assert params == {"t": 9, "hashes_0": 5, "hashes_1": 6}
    sql, params = bind_lists("SELECT 1 WHERE h IN ($hashes[])", {"hashes": []})
    assert (sql, params) == ("SELECT 1 WHERE h IN (NULL)", {})


def test_recent_keys_drop_repeats_and_forget_after_two_generations():
    recent = RecentKeys(capacity=4)
    keys = np.array([1, 2, 3], dtype=np.uint64)
    assert recent.fresh(keys).tolist() == [True, True, True]
    assert recent.fresh(np.array([3, 4], dtype=np.uint64)).tolist() == [False, True]  # 5 keys: rotates
    assert recent.fresh(np.array([1, 9], dtype=np.uint64)).tolist() == [False, True]  # 1 is in the old one
    assert recent.fresh(np.array([7, 8, 10], dtype=np.uint64)).tolist() == [True, True, True]  # rotates
    assert recent.fresh(np.array([2, 1], dtype=np.uint64)).tolist() == [True, False]  # 2 was forgotten


def test_sightings_keep_the_first_appearance_of_each_key_once(tmp_path):
    body, _ = golden.encode(golden.load("golden_engine_trace.json"), 1_790_000_000_000_000_000)
    batch = normalize(ExportTraceServiceRequest.FromString(body))
    store = DuckDBStore(tmp_path / "s.duckdb")
    store.write(batch)
    store.write(batch)  # the same blocks again: recorded once
    assert store.counts()["prefix_blocks"] == 2 * sum(len(row[-1]) for row in batch.packed["prefix_blocks"])
    cursor = store._cursor()
    [(sightings,)] = cursor.execute("SELECT count(*) FROM prefix_sightings").fetchall()
    [(keys,)] = cursor.execute("SELECT count(DISTINCT (hash, instance_id, source)) FROM prefix_blocks").fetchall()
    assert sightings == keys
    # The first appearance of each key is the earliest row of that key in prefix_blocks.
    first = cursor.execute("SELECT hash, instance_id, source, min(t_ns) FROM prefix_blocks "
                           "GROUP BY ALL ORDER BY ALL").fetchall()
    assert cursor.execute("SELECT hash, instance_id, source, t_ns FROM prefix_sightings ORDER BY ALL").fetchall() \
        == first
    store.close()
