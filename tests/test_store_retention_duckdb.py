"""Retention and the disk budget of a DuckDB store (issue 45 item 3; collector/stores/retention.py).

- A pass over real engine traffic: every table loses exactly what started before the floor, and the
  cache verdict of a request kept after it still finds the first kept holder of its prompt (a pass
  that only deleted rows made it "never seen"); the block lists' first new blocks equal what a
  computation over the kept rows alone gives.
- Span files: a file past the floor is delisted and deleted, one that straddles it shows only its
  newer spans, across a restart.
- A collector with ``--retention`` expires by itself and remembers its retention; with
  ``--max-disk-bytes`` it refuses as on a full disk (503 + Retry-After) and takes writes again by
  itself once retention frees room, everything it acknowledged and kept still stored.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from harness_collector import CollectorProcess, wait_for
from harness_engine import EngineProcess
from test_collector_errors import make_request

from tokentrace.collector.decoding.normalize import normalize
from tokentrace.collector.stores import frontier, span_files
from tokentrace.collector.stores.store_duckdb import TIMED, DuckDBStore
from tokentrace.demo_workload import chat

PB = "application/x-protobuf"
HOUR = 3600 * 10**9
SYSTEM = {"role": "system", "content": "You keep the cluster's field notes. " * 6}
PROMPT = [SYSTEM, {"role": "user", "content": "Which node held the layers when the ring stalled? " * 3}]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokentrace", *args], capture_output=True, text=True, timeout=120)


def _cache(db, request_id: str) -> dict:
    result = _cli("analyze", "cache", "--request-id", request_id, "--db", str(db), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _elsewhere(verdict: dict) -> dict:
    [item] = [e for e in verdict["evidence"] if e["kind"] == "cached_elsewhere"]
    return item


@pytest.fixture(scope="module")
def traffic(tmp_path_factory, tiny_model):
    """Two engines, one collector: prompt P first on instance a (before the floor), then again on a
    and on b (after it), with other requests around; every process stopped, the store closed."""
    workdir = tmp_path_factory.mktemp("retention")
    collector = CollectorProcess(workdir).start()
    engines = [EngineProcess(workdir, tiny_model, collector=collector, instance_id=name) for name in ("ret-a", "ret-b")]
    try:
        for engine in engines:
            engine.start()
        a, b = (engine.url for engine in engines)
        for i in range(3):
            chat(a, f"old-{i}", [{"role": "user", "content": f"an early question number {i} " * 4}], 4)
        chat(a, "ret-first", PROMPT, 4)
        chat(a, "ret-second", PROMPT, 4)
        chat(b, "ret-moved", PROMPT, 4)
        chat(a, "new-0", [{"role": "user", "content": "a later question " * 4}], 4)
    finally:
        for engine in engines:
            assert engine.stop() == 0, engine.log_path.read_text()
        assert collector.stop() == 0, collector.log_path.read_text()
    return collector


def _times(store: DuckDBStore) -> dict[str, tuple[int, int]]:
    """Per request id, the earliest and latest time of any row a table holds for it."""
    cursor = store._thread_cursor()
    found: dict[str, list[int]] = {}
    for table, column in TIMED:
        names = {name for (name,) in cursor.execute(
            "SELECT column_name FROM duckdb_columns() WHERE table_name = ?", [table]).fetchall()}
        if "request_id" not in names:
            continue
        for rid, low, high in cursor.execute(
                f"SELECT request_id, min({column}), max({column}) FROM {table} GROUP BY request_id").fetchall():
            found.setdefault(rid, []).extend((low, high))
    return {rid: (min(values), max(values)) for rid, values in found.items() if rid}


def _from_scratch(store: DuckDBStore) -> list[tuple]:
    """``fresh_from`` of every kept block list computed over the kept lists alone, in the store's
    order (what the store would hold had it never seen the deleted ones)."""
    cursor = store._thread_cursor()
    table = cursor.sql("SELECT rowid, request_id, instance_id, t_ns, source, fingerprint, hashes, fresh_from "
                       "FROM prefix_block_lists ORDER BY rowid").pl().to_arrow()
    staged = table.select(["request_id", "instance_id", "t_ns", "source", "fingerprint", "hashes"])
    fresh, _ = frontier.fresh_frontiers(staged, frontier.RecentKeys())
    kept = table.column("fresh_from").to_pylist()
    return list(zip(table.column("rowid").to_pylist(), kept, fresh.to_pylist(), strict=True))


def test_a_pass_drops_what_started_before_the_floor_and_keeps_the_cache_verdict_right(traffic):
    db = traffic.db
    before = _cache(db, "ret-moved")
    assert before["cause"] == "instance_change" and _elsewhere(before)["entry_request_id"] == "ret-first"

    store = DuckDBStore(db)
    try:
        times = _times(store)
        floor = times["ret-second"][0]
        assert times["ret-first"][1] < floor  # the situation: everything of ret-first before the floor
        done = store.expire(floor)
        assert done["rows"]["requests"] == 4 and done["frontiers_moved"] > 0
        cursor = store._thread_cursor()
        for table, column in TIMED:
            [(older,)] = cursor.execute(f"SELECT count(*) FROM {table} WHERE {column} < ?", [floor]).fetchall()
            assert older == 0, table
        kept = _times(store)
        assert not {"old-0", "old-1", "old-2", "ret-first"} & set(kept)
        assert {"ret-second", "ret-moved", "new-0"} <= set(kept)
        # The differential: the first new block of every kept list is what the kept lists alone give.
        differ = [(row, stored, scratch) for row, stored, scratch in _from_scratch(store) if stored != scratch]
        assert not differ
        state = store.journal_state()["retention"]
        assert state["last_pass"]["floor_ns"] == floor and state["seconds"] == 0  # a pass asked for, no setting
    finally:
        store.close()

    after = _cache(db, "ret-moved")
    # The prompt's first holder on ret-a is now ret-second: the verdict still knows it was cached there.
    assert after["cause"] == "instance_change", after
    assert _elsewhere(after)["entry_request_id"] == "ret-second"
    assert after["prompt_tokens"] == before["prompt_tokens"] and after["cached_tokens"] == before["cached_tokens"]
    gone = _cli("analyze", "slow", "--request-id", "ret-first", "--db", str(db))
    assert gone.returncode != 0 and "ret-first" in gone.stderr and "Traceback" not in gone.stderr


def _spans(count: int, start_ns: int, step_ns: int, name: str):
    request = make_request(count, name=name)
    for i, span in enumerate(request.resource_spans[0].scope_spans[0].spans):
        span.start_time_unix_nano = start_ns + i * step_ns
        span.end_time_unix_nano = span.start_time_unix_nano + 1000
    return request


def _counts(store: DuckDBStore) -> dict[str, int]:
    return dict(store._thread_cursor().execute("SELECT name, count(*) FROM spans GROUP BY name").fetchall())


def test_span_files_past_the_floor_go_and_a_straddling_file_shows_only_its_newer_spans(tmp_path, monkeypatch):
    monkeypatch.setattr(span_files, "GRACE_S", 0.0)  # no read is planned against the old file here
    path = tmp_path / "s.duckdb"
    now = time.time_ns()
    store = DuckDBStore(path)
    try:
        straddle = _spans(9000, now - HOUR - 4500 * 10**6, 10**6, "straddle")  # one span a ms, half older
        for request in (_spans(9000, now - 2 * HOUR, 0, "old"), _spans(9000, now, 0, "new"), straddle,
                        _spans(5, now - 2 * HOUR, 0, "few")):
            store.write(normalize(request))
            store.settle()  # one merge each: three span files, the few spans in span_rows
        assert store.journal_state()["span_files"]["files"] == 3
        files_before = store.usage()["span_files"]
        done = store.expire(now - HOUR)
        assert done["span_files"] == 1 and done["file_spans"] == 9000 and done["rows"]["span_rows"] == 5
        assert _counts(store) == {"new": 9000, "straddle": 4500}
        oldest = store._thread_cursor().execute("SELECT min(start_ns) FROM spans").fetchall()[0][0]
        assert oldest >= now - HOUR
        wait_for(lambda: sorted(p.name for p in (tmp_path / "s.duckdb.spans").iterdir())
                 == ["000000000002.parquet", "000000000003.parquet"], 10, "the expired span file to be deleted")
        assert store.usage()["span_files"] < files_before
        store.retain(7200)  # longer than the pass's floor: it brings nothing back
    finally:
        store.close()
    again = DuckDBStore(path)  # the floor and the retention are the store's
    try:
        assert _counts(again) == {"new": 9000, "straddle": 4500}
        assert again.journal_state()["retention"]["seconds"] == 7200
    finally:
        again.close()


def _post(collector: CollectorProcess, request) -> httpx.Response:
    return collector.post(request.SerializeToString(), PB)


def test_a_collector_with_retention_expires_by_itself_and_remembers_it(tmp_path):
    collector = CollectorProcess(tmp_path, "--retention", "1m").start()
    try:
        now = time.time_ns()
        assert _post(collector, _spans(20, now - 10 * 60 * 10**9, 0, "stale")).status_code == 200
        assert _post(collector, _spans(20, now, 0, "fresh")).status_code == 200
        # The first pass ran at the start; the next within a tenth of the retention (6 s).
        wait_for(lambda: collector.health()["journal"]["retention"]["last_pass"].get("rows", {}).get("span_rows"),
                 30, "a retention pass to drop the stale spans")
        health = collector.health()["journal"]["retention"]
        assert health["seconds"] == 60 and health["last_pass"]["rows"]["span_rows"] == 20
    finally:
        assert collector.stop() == 0, collector.log_path.read_text()
    assert dict(collector.sql("SELECT name, count(*) FROM spans GROUP BY name")) == {"fresh": 20}
    again = CollectorProcess(tmp_path, db=collector.db).start()  # no --retention: the store's own
    try:
        assert again.health()["journal"]["retention"]["seconds"] == 60
    finally:
        again.stop()
    off = CollectorProcess(tmp_path, "--retention", "off", db=collector.db).start()
    try:
        assert off.health()["journal"]["retention"]["seconds"] == 0
    finally:
        off.stop()


def _blob(request):
    """``request`` with about 0.5 MB of attributes that compress poorly."""
    for span in request.resource_spans[0].scope_spans[0].spans:
        span.attributes.add(key="blob").value.string_value = os.urandom(30_000).hex()
    return request


def test_the_disk_budget_refuses_as_overload_and_takes_writes_again_once_retention_frees_room(tmp_path):
    probe = CollectorProcess(tmp_path).start()
    base = probe.health()["journal"]["disk"]["total"]
    probe.stop()
    budget = base + (6 << 20)
    collector = CollectorProcess(tmp_path, "--retention", "1m", "--max-disk-bytes", str(budget),
                                 db=probe.db).start()
    kept: list[str] = []
    try:
        now, refused = time.time_ns(), None
        for i in range(60):
            answer = _post(collector, _blob(_spans(8, now - 10 * 60 * 10**9, 0, f"stale-{i}")))  # past 1m
            if answer.status_code != 200:
                refused = answer
                break
            fresh = _post(collector, _spans(1, time.time_ns(), 0, f"kept-{i}"))
            if fresh.status_code == 200:
                kept.append(f"kept-{i}")
        assert refused is not None, "the budget never refused a write"
        refused_ns = time.time_ns()
        assert refused.status_code == 503 and "retry-after" in refused.headers, refused.text
        assert "--max-disk-bytes" in refused.text
        health = httpx.get(collector.url + "/healthz", timeout=30)
        assert health.json()["journal"]["disk"]["budget"] == budget

        def accepted():  # as large as a refused body, spans of now: only room frees it
            return _post(collector, _blob(_spans(8, time.time_ns(), 0, "after"))).status_code == 200

        wait_for(accepted, 60, "a write to pass again once retention frees room", interval=1.0)
        # A pass that began after every stale batch was merged (the second after the refusal).
        wait_for(lambda: collector.health()["journal"]["retention"]["last_pass"]["floor_ns"]
                 > refused_ns - 60 * 10**9 + 7 * 10**9, 30, "a retention pass after the refusal")
    finally:
        assert collector.stop() == 0, collector.log_path.read_text()
    names = {name for (name,) in collector.sql("SELECT DISTINCT name FROM spans")}
    assert kept and set(kept) <= names and "after" in names
    assert not any(name.startswith("stale-") for name in names)


def test_timed_tables_are_every_table_the_normalizer_writes():
    from tokentrace.collector.decoding.tables import TABLES

    assert len(TIMED) == len(TABLES)
    assert ("span_rows", "start_ns") in TIMED and ("prefix_block_lists", "t_ns") in TIMED
    assert ("decode_step_lists", "start_ns") in TIMED and ("resources", "seen_ns") in TIMED
