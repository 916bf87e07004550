"""Real collector processes on a ClickHouse store: chdb in-process here, a server when
TOKENTRACE_CLICKHOUSE_URL is set (skipped otherwise, and the skip says so)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import golden
import pytest
from harness_collector import wait_for
from harness_store import clickhouse_available, server_url, sql, unique_database
from test_collector_durability import _stream
from test_collector_errors import make_request

from tokentrace.collector import stores
from tokentrace.collector.ingest import Counters, Pipeline
from tokentrace.collector.otlp import PROTOBUF, Encoding
from tokentrace.collector.store import SpoolRecord

pytestmark = pytest.mark.skipif(not clickhouse_available(), reason="the clickhouse extra is not installed")


def _open(url: str):
    return stores.open_store(stores.parse(url))


def test_golden_trace_through_a_chdb_collector(collector_factory, tmp_path):
    url = f"chdb://{tmp_path / 'chdb'}"
    collector = collector_factory(store=url).start()
    assert collector.health()["store"]["path"] == url
    base = time.time_ns() - 5_000_000_000
    ids = golden.replay(golden.load("golden_engine_trace.json"), collector.url + "/v1/traces", base)
    assert collector.stop() == 0
    store = _open(url)
    try:
        request = store.request("golden-req-1")
        assert (request["start_ns"] - base, request["ttft_ms"], request["cached_tokens"]) == (100_000_000, 500.0, 16)
        assert store.trace(ids["req"][0]).height == 9
        assert store.counts()["spans"] == 17
    finally:
        store.close()


def test_kill_9_on_chdb_keeps_every_acknowledged_span(collector_factory, tmp_path):
    url = f"chdb://{tmp_path / 'chdb'}"
    collector = collector_factory(store=url).start()
    acked: list[str] = []
    stop = threading.Event()
    threads = _stream(collector, acked, stop)
    wait_for(lambda: len(acked) >= 2000, 120, "2000 acknowledged spans")
    collector.kill()
    stop.set()
    for thread in threads:
        thread.join(30)
    snapshot = list(acked)
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


def test_spool_file_re_ingested_after_a_crash_mid_batch_is_stored_once(chdb_dir):
    store = _open(f"chdb://{chdb_dir}?database={unique_database('spool')}")
    try:
        batch = Pipeline(Counters(), 1 << 24, 65536).batch(
            golden.encode(golden.load("golden_engine_trace.json"), time.time_ns())[0], Encoding("protobuf", PROTOBUF))
        record = SpoolRecord("ef" * 32, "crash.pb")
        store._writer = _CrashOnce(store._writer, "requests")  # every table before requests is in
        with pytest.raises(Exception, match="injected"):
            store.write(batch, record)
        assert store.counts()["spans"] == 17 and store.counts()["requests"] == 0
        assert not store.spool_seen(record.sha256)
        assert store.write(batch, record) is True  # the restart re-ingests the file
        counts = store.counts()
        assert (counts["spans"], counts["requests"], counts["prefix_blocks"]) == (17, 1, 7)
        assert store.spool_seen(record.sha256)
        assert store.write(batch, record) is False
    finally:
        store.close()


def test_two_collectors_share_one_clickhouse_server(collector_factory):
    """Requests split between two collectors on one server: each sees what the other wrote."""
    base_url = server_url()
    url = base_url.split("?")[0].rsplit("/", 1)[0] + "/" + unique_database("shared")
    first = collector_factory(store=url).start()
    second = collector_factory(store=url).start()
    fixture = golden.load("golden_engine_trace.json")
    base = time.time_ns() - 5_000_000_000
    ids = golden.replay(fixture, first.url + "/v1/traces", base)
    assert second.post(make_request(3, name="via-second").SerializeToString(),
                       "application/x-protobuf").status_code == 200
    store = _open(url)
    try:
        assert store.request("golden-req-1") is not None
        assert store.trace(ids["req"][0]).height == 9
        assert sql(store, "SELECT count() FROM spans WHERE name = 'via-second'") == [(3,)]
    finally:
        store.close()
    assert first.stop() == 0 and second.stop() == 0
