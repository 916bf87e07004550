"""DuckDB store internals that keep verdicts fast: list parameters, the sightings filter, and the
plans of the hash lookups (an index scan, not a scan of every row; bench/analyze.py has the times).
"""

from __future__ import annotations

import json

import golden
import numpy as np
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace.collector import sqlfiles
from tokentrace.collector.normalize import normalize
from tokentrace.collector.store_duckdb import DuckDBStore, RecentKeys, bind_lists, first_sightings


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
    again, _ = golden.encode(golden.load("golden_engine_trace.json"), 1_790_000_000_000_000_000)
    store.write(normalize(ExportTraceServiceRequest.FromString(again)))  # other spans, the same blocks
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


def _scans(cursor, sql: str, params: dict) -> list[str]:
    """The scan type of every table scan in the executed plan (EXPLAIN ANALYZE, JSON)."""
    plan = json.loads(cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params).fetchall()[0][1])
    found, pending = [], list(plan["operator"])
    while pending:
        node = pending.pop()
        pending.extend(node.get("children", []))
        if node.get("name") == "SEQ_SCAN":
            found.append(node["extra_info"].get("Type"))
    return found


@pytest.mark.parametrize("name", ["prefix_sightings_of", "segment_matches"])
def test_hash_lookups_take_the_art_index(tmp_path, name):
    """A second filter in the same scan (t_ns < before) turns DuckDB's index scan into a scan of the
    whole table: 180 ms instead of 7 ms per cache verdict at 53M sightings. Several hashes, as a
    verdict asks (one value would be an equality, which keeps the index either way)."""
    store = DuckDBStore(tmp_path / "s.duckdb")
    for base in (1_790_000_000_000_000_000, 1_790_000_010_000_000_000):  # the same trace 10 s later
        body, _ = golden.encode(golden.load("golden_engine_trace.json"), base)
        store.write(normalize(ExportTraceServiceRequest.FromString(body)))
    cursor = store._cursor()
    table = "prefix_sightings" if name == "prefix_sightings_of" else "segments"
    hashes = [row[0] for row in cursor.execute(f"SELECT DISTINCT hash FROM {table} ORDER BY hash").fetchall()]
    assert len(hashes) >= 2
    # A moment inside the table's time range, so that its statistics cannot drop the time filter.
    [(before,)] = cursor.execute(f"SELECT max(t_ns) FROM {table}").fetchall()
    text = store._queries.text(name)
    params = {k: v for k, v in {"hashes": hashes, "before_ns": before, "request_id": "another"}.items()
              if f"${k}" in text}
    sql, bound = bind_lists(text, params)
    assert _scans(cursor, sql, bound) == ["Index Scan"]
    store.close()


def test_first_sightings_match_the_sql_reference(tmp_path):
    """The writer's numpy grouping (store_duckdb.first_sightings) keeps, for each (hash, instance,
    source), the earliest staged block, as sql/duckdb/expand/prefix_sightings.sql states it: the
    same keys and times, NULL instances included; ties keep the first block staged."""
    rng = np.random.default_rng(17)
    store = DuckDBStore(tmp_path / "s.duckdb")
    rows = []
    for n in range(300):
        hashes = [int(h) for h in rng.integers(-40, 40, size=int(rng.integers(0, 12)))]  # repeats within a row
        rows.append((f"r{n}", [None, "a", "b"][n % 3], int(rng.integers(0, 20)) * 1000, ["lookup", "insert"][n % 2],
                     int(rng.integers(0, 2**62)) if n % 2 else None, hashes))
    staged = store._arrow("packed:prefix_blocks", rows)
    recent = RecentKeys()
    got = first_sightings(staged, recent).to_pylist()
    cursor = store._cursor()
    cursor.register("staged", staged)
    expected = cursor.execute(sqlfiles.read("duckdb", "expand/prefix_sightings.sql")).fetchall()
    assert sorted((r["hash"], r["instance_id"] or "", r["source"], r["t_ns"]) for r in got) \
        == sorted((h, inst or "", source, t) for h, _, t, _, inst, source, _ in expected)
    first: dict = {}
    for rid, inst, t_ns, source, fingerprint, hashes in rows:
        for index, value in enumerate(hashes):
            key = (value, inst, source)
            if key not in first or t_ns < first[key]["t_ns"]:
                first[key] = {"hash": value, "block_index": index, "t_ns": t_ns, "request_id": rid,
                              "instance_id": inst, "source": source, "fingerprint": fingerprint}
    assert sorted(got, key=repr) == sorted(first.values(), key=repr)
    assert first_sightings(staged, recent) is None  # every key recorded now: nothing new to append
    store.close()
