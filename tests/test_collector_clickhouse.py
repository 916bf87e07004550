"""Real collector processes on a ClickHouse store: chdb in-process here, a server when
TOKENTRACE_CLICKHOUSE_URL is set (skipped otherwise, and the skip says so)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import golden
import httpx
import pytest
from harness_store import clickhouse_available, server_database_url, sql, unique_database
from test_collector_durability import kill_mid_stream

from tokentrace.collector import stores
from tokentrace.collector.receiver.ingest import Counters, Pipeline
from tokentrace.collector.receiver.otlp import PROTOBUF, Encoding
from tokentrace.collector.stores.store import SpoolRecord

pytestmark = pytest.mark.skipif(not clickhouse_available(), reason="the clickhouse extra is not installed")


def _open(url: str):
    return stores.open_store(stores.parse(url))


def _verdict(collector, request_id: str) -> dict:
    response = httpx.get(f"{collector.url}/api/requests/{request_id}/verdict", timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_golden_trace_through_a_chdb_collector_gives_duckdb_verdicts(collector_factory, tmp_path):
    url = f"chdb://{tmp_path / 'chdb'}"
    on_chdb = collector_factory(store=url).start()
    on_duckdb = collector_factory().start()
    assert on_chdb.health()["store"]["path"] == url
    base = time.time_ns() - 5_000_000_000
    fixture = golden.load("golden_engine_trace.json")
    for collector in (on_chdb, on_duckdb):
        golden.replay(fixture, collector.url + "/v1/traces", base)
    verdict = _verdict(on_chdb, "golden-req-1")
    assert (verdict["slow"]["category"], verdict["cache"]["result"]) == ("cold_start", "hit")
    assert verdict == _verdict(on_duckdb, "golden-req-1")
    cli = subprocess.run([sys.executable, "-m", "tokentrace", "analyze", "slow", "--request-id", "golden-req-1",
                          "--url", on_chdb.url, "--json"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout) == verdict["slow"]
    assert httpx.get(f"{on_chdb.url}/api/requests/nope/slow", timeout=30).status_code == 404
    assert on_chdb.stop() == 0
    store = _open(url)
    try:
        request = store.request("golden-req-1")
        assert (request["start_ns"] - base, request["ttft_ms"], request["cached_tokens"]) == (100_000_000, 500.0, 16)
        assert store.counts()["spans"] == 18
    finally:
        store.close()


def test_kill_9_on_chdb_keeps_every_acknowledged_span(collector_factory, tmp_path):
    url = f"chdb://{tmp_path / 'chdb'}"
    snapshot = kill_mid_stream(collector_factory(store=url).start(), 2000)
    restarted = collector_factory(store=url).start()  # chdb's directory lock died with the process
    assert restarted.stop() == 0
    store = _open(url)
    try:
        [(stored,)] = sql(store, "SELECT uniqExact(span_id) FROM spans WHERE has({ids:Array(String)}, span_id)",
                          ids=snapshot)
    finally:
        store.close()
    assert stored == len(snapshot)


def test_a_second_collector_on_the_same_chdb_directory_fails_fast_and_says_why(collector_factory, tmp_path):
    url = f"chdb://{tmp_path / 'chdb'}"
    first = collector_factory(store=url).start()
    second = subprocess.run(
        [sys.executable, "-m", "tokentrace", "collector", "--store", url, "--port", "1"],
        capture_output=True, text=True, timeout=120)
    assert second.returncode == 1
    assert "held by another process" in second.stderr and "Traceback" not in second.stderr
    assert first.health()["status"] == "ok"


class _CrashOnce:
    """Makes the client fail the INSERT of one table once: a collector dying mid-batch."""

    def __init__(self, client, table: str):
        self.client, self.table, self.crashed = client, table, False

    def __getattr__(self, name):
        return getattr(self.client, name)

    def insert_arrow(self, table, data, settings=None):
        if table == self.table and not self.crashed:
            self.crashed = True
            from clickhouse_connect.driver.exceptions import OperationalError

            raise OperationalError("injected: the collector died here")
        return self.client.insert_arrow(table, data, settings=settings)


@pytest.mark.parametrize("spooled", [True, False], ids=["spool file", "plain resend"])
def test_a_batch_written_again_after_a_crash_mid_batch_is_stored_once(chdb_dir, spooled):
    store = _open(f"chdb://{chdb_dir}?database={unique_database('spool')}")
    try:
        batch = Pipeline(Counters(), 1 << 24, 65536).batch(
            golden.encode(golden.load("golden_engine_trace.json"), time.time_ns())[0], Encoding("protobuf", PROTOBUF))
        record = SpoolRecord("ef" * 32, "crash.pb") if spooled else None
        store._writer = _CrashOnce(store._writer, "requests")  # every table before requests is in
        with pytest.raises(Exception, match="injected"):
            store.write(batch, record)
        counts = store.counts()
        assert (counts["spans"], counts["requests"], counts["prefix_blocks"]) == (0, 0, 7)  # spans go last
        assert store.write(batch, record) is True  # the restart re-ingests the file, or the sender resends
        counts = store.counts()
        assert (counts["spans"], counts["requests"], counts["prefix_blocks"]) == (18, 1, 7)
        if spooled:
            assert store.spool_seen(record.sha256)
            assert store.write(batch, record) is False
        else:
            assert store.write(batch, record) is True and batch.duplicates == 18
            assert store.counts() == counts
    finally:
        store.close()


@pytest.mark.parametrize("where", ["chdb", "as on a server"])
def test_a_batch_whose_spans_part_was_lost_after_its_token_was_logged_is_stored_again(chdb_dir, where, caplog):
    """A kill -9 between MergeTree's deduplication log write and the part's commit leaves a token
    without rows; the resend's ``spans`` INSERT carried the same token and ClickHouse dropped it
    (1,980 of 2,000 spans in the kill -9 test of test_collector_once.py, once in many runs). The
    window is microseconds wide, so a DELETE of the spans stands in for the lost part: the
    deduplication log keeps the tokens. On chdb each open has its own ``spans`` tokens; a server
    outlives collectors, so there the writer checks the spans are in (a store without its open's
    id stands in for one: no server here)."""
    url = f"chdb://{chdb_dir}?database={unique_database('lost')}"
    batch = Pipeline(Counters(), 1 << 24, 65536).batch(
        golden.encode(golden.load("golden_engine_trace.json"), time.time_ns() - 10**9)[0],
        Encoding("protobuf", PROTOBUF))
    store = _open(url)
    try:
        if where != "chdb":
            store._life = ""
        assert store.write(batch) is True
        before = store.counts()
        assert before["spans"] == 18
        sql(store, "DELETE FROM spans WHERE 1 = 1")
        assert store.counts()["spans"] == 0
    finally:
        store.close()
    restarted = _open(url)  # its key memory comes from the store: the spans are not there
    try:
        if where != "chdb":
            restarted._life = ""
        assert restarted.write(batch) is True  # the same rows, so the same tokens but for chdb's open id
        assert restarted.counts() == before  # the spans again, every other table's rows once
        assert ("inserting them again" in caplog.text) == (where != "chdb")
        assert restarted.write(batch) is True and batch.duplicates == 18
        assert restarted.counts() == before
    finally:
        restarted.close()


def _split(fixture: dict) -> tuple[dict, dict]:
    """The golden trace as two exports: the request's spans, and the model load it waited on."""
    load = {"load", "resolve", "shard", "weights", "tok", "warm"}
    request = [s for s in fixture["spans"] if s["id"] not in load]
    return {**fixture, "spans": request}, {**fixture, "spans": [s for s in fixture["spans"] if s["id"] in load]}


def _split_verdicts(first, second) -> None:
    """The request to ``first``, the model load it waited on to ``second``: both must serve the
    same, complete verdict."""
    request_part, load_part = _split(golden.load("golden_engine_trace.json"))
    base = time.time_ns() - 5_000_000_000
    golden.replay(request_part, first.url + "/v1/traces", base)
    golden.replay(load_part, second.url + "/v1/traces", base)
    verdicts = [_verdict(collector, "golden-req-1") for collector in (first, second)]
    assert verdicts[0] == verdicts[1]
    slow = verdicts[0]["slow"]
    assert slow["category"] == "cold_start"
    assert "load-1" in json.dumps(slow["evidence"])  # the load, written by the other collector


def _chdb_before(chdb_dir, database: str, version: int, fill) -> None:
    """Database ``database`` of a chdb store as a collector from before migration ``version`` left
    it: the migrations below it applied and recorded, then ``fill(client)`` writes its old rows."""
    from tokentrace.collector.stores import sqlfiles
    from tokentrace.collector.stores.store_clickhouse import Target

    target = Target(database, path=str(chdb_dir))
    admin = target.client(None)
    admin.command("CREATE DATABASE {db:Identifier}", parameters={"db": database})
    old = target.client(database)
    old.command("CREATE TABLE schema_migrations (version Int64, name String, applied_ns Int64) "
                "ENGINE = MergeTree ORDER BY version")
    for number, name, script in sqlfiles.migrations("clickhouse"):
        if number < version:
            for statement in sqlfiles.statements(script):
                old.command(statement)
            old.insert("schema_migrations", [(number, name, 0)], column_names=["version", "name", "applied_ns"])
    fill(old)
    old.close()
    admin.close()


def test_a_chdb_store_written_before_009_keeps_its_phases_without_their_span_ids(chdb_dir):
    """ClickHouse migration 009 drops the trace, span and parent span ids from phases (issue 17, as
    DuckDB's 012 does): a database an earlier version wrote keeps every phase row with its other
    columns, and the slowness verdict's phases query reads them and the rows written after alike."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from tokentrace.collector.decoding.normalize import normalize
    from tokentrace.collector.decoding.tables import TABLES

    database, now = unique_database("before009"), time.time_ns()
    phases = normalize(ExportTraceServiceRequest.FromString(
        golden.encode(golden.load("golden_engine_trace.json"), now)[0])).expanded("phases")
    assert phases and len(phases[0]) == len(TABLES["phases"])
    with_ids = ["request_id", "instance_id", "trace_id", "span_id", "parent_span_id", *TABLES["phases"][2:]]
    _chdb_before(chdb_dir, database, 9, lambda old: old.insert(
        "phases", [(r[0], r[1], f"{n:032x}", f"{n:016x}", None, *r[2:]) for n, r in enumerate(phases)],
        column_names=with_ids))
    store = _open(f"chdb://{chdb_dir}?database={database}")
    try:
        assert [name for (name,) in sql(store, "SELECT name FROM system.columns WHERE database = {db:String} "
                                        "AND table = 'phases' ORDER BY position", db=database)] == \
            list(TABLES["phases"])
        assert sorted(sql(store, "SELECT * FROM phases"), key=repr) == sorted(phases, key=repr)
        batch = Pipeline(Counters(), 1 << 24, 65536).batch(
            golden.encode(golden.load("golden_engine_trace.json"), now + 60 * 10**9)[0], Encoding("protobuf", PROTOBUF))
        assert store.write(batch) is True
        rid = phases[0][0]
        start = min(r[3] for r in phases if r[0] == rid)
        for offset in (0, 60 * 10**9):
            got = store.rows("phases", request_id=rid, t0_ns=start + offset, t1_ns=start + offset + 10**12)
            assert {row["name"] for row in got} == {r[2] for r in phases if r[0] == rid}
            assert "span_id" not in got[0]
    finally:
        store.close()


def test_a_chdb_store_written_before_014_gains_limit_rank_undeclared_for_its_earlier_inserts(chdb_dir):
    """ClickHouse migration 014 adds cache_inserts.limit_rank (as DuckDB's 021) without filling the
    rows stored before (they stay undeclared: the cache verdict reads None, the byte limit counted as
    rank 0's); an insert written after it has what its span declared, on the verdict's read too."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from tokentrace.analyzers.cache import _declared_limit_rank
    from tokentrace.collector.decoding.normalize import normalize
    from tokentrace.collector.decoding.tables import TABLES

    database, now = unique_database("before014"), time.time_ns()
    inserts = normalize(ExportTraceServiceRequest.FromString(
        golden.encode(golden.load("golden_engine_trace.json"), now)[0])).expanded("cache_inserts")
    assert [row[-1] for row in inserts] == [1]  # the golden insert declares rank 1
    _chdb_before(chdb_dir, database, 14, lambda old: old.insert(
        "cache_inserts", [row[:-1] for row in inserts], column_names=list(TABLES["cache_inserts"][:-1])))
    store = _open(f"chdb://{chdb_dir}?database={database}")
    try:
        assert [name for (name,) in sql(store, "SELECT name FROM system.columns WHERE database = {db:String} "
                                        "AND table = 'cache_inserts' ORDER BY position", db=database)] == \
            list(TABLES["cache_inserts"])
        assert sql(store, "SELECT limit_rank FROM cache_inserts") == [(None,)]
        evicted_ns = inserts[0][2] + 500_000  # the golden insert's eviction
        eviction = {"evicted_by_request_id": "golden-req-1", "t_ns": evicted_ns}
        assert _declared_limit_rank(store, "golden-1", eviction) is None
        batch = Pipeline(Counters(), 1 << 24, 65536).batch(
            golden.encode(golden.load("golden_engine_trace.json"), now + 60 * 10**9)[0], Encoding("protobuf", PROTOBUF))
        assert store.write(batch) is True
        later = {**eviction, "t_ns": evicted_ns + 60 * 10**9}
        assert _declared_limit_rank(store, "golden-1", later) == 1
        assert _declared_limit_rank(store, None, later) is None
    finally:
        store.close()


def test_split_exports_on_one_chdb_collector(collector_factory, tmp_path):
    """chdb allows one process per directory, so here both halves go to one collector: the same
    checks as the two-collector server test below, which runs only against a real server."""
    collector = collector_factory(store=f"chdb://{tmp_path / 'chdb'}").start()
    _split_verdicts(collector, collector)


def test_two_collectors_share_one_clickhouse_server(collector_factory):
    """A verdict needs spans the other collector wrote (issue 7)."""
    url = server_database_url("shared")
    first = collector_factory(store=url).start()
    second = collector_factory(store=url).start()
    _split_verdicts(first, second)
    assert first.stop() == 0 and second.stop() == 0
