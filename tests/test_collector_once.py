"""Exactly once, whatever the sender retries (issue 11 item 2), against real collector processes on
DuckDB and chdb: resends over HTTP, the same spans as a spool file, and resends after kill -9 leave
the report, the overview, ``analyze report`` and every table as one delivery left them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import golden
import httpx
import polars as pl
import pytest
from harness_collector import CollectorProcess, wait_for
from harness_store import COLLECTOR_BACKENDS, collector_store
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from test_collector_errors import make_request

from tokentrace.collector import stores
from tokentrace.collector.decoding.normalize import TABLES

PROTOBUF = "application/x-protobuf"


def _bodies(count: int) -> list[bytes]:
    """``count`` distinct engine requests (the golden trace, a second apart, in the last minutes)."""
    fixture = golden.load("golden_engine_trace.json")
    base = time.time_ns() - 300 * 10**9
    return [golden.encode(fixture, base + i * 10**9)[0] for i in range(count)]


def _spans(body: bytes) -> int:
    request = ExportTraceServiceRequest.FromString(body)
    return sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)


def _start(factory, backend: str, tmp_path, name: str, *args: str) -> CollectorProcess:
    (tmp_path / name).mkdir(exist_ok=True)
    store = collector_store(backend, tmp_path / name)
    return factory(*args, store=store, db=tmp_path / name / "store.duckdb").start()


def _views(collector: CollectorProcess) -> dict:
    """Requests counted by /api/report, the overview's twin and ``analyze report`` (asking the collector)."""
    get = lambda path: httpx.get(collector.url + path, timeout=60).json()  # noqa: E731
    cli = subprocess.run([sys.executable, "-m", "tokentrace", "analyze", "report", "--url", collector.url,
                          "--since", "1h", "--json"], capture_output=True, text=True, timeout=120, check=True)
    report = {k: v for k, v in get("/api/report?since=1h").items() if k not in ("since_ns", "until_ns")}
    return {"api": report["requests"], "overview": get("/.json?since=1h")["requests"],
            "cli": json.loads(cli.stdout)["requests"], "report": report}


def _tables(collector: CollectorProcess) -> dict[str, list[str]]:
    """Every table's rows, sorted (the collector stopped)."""
    store = stores.open_store(stores.parse(collector.store) if collector.store
                              else stores.StoreURL("duckdb", str(collector.db)))
    try:
        out = {}
        for table in TABLES:
            if hasattr(store, "_cursor"):
                frame = store._cursor().sql(f"SELECT * FROM {table}").pl()
            else:
                frame = pl.from_arrow(store._reader().query_arrow("SELECT * FROM {t:Identifier}",
                                                                  parameters={"t": table}))
            out[table] = sorted(map(repr, frame.rows()))
        return out
    finally:
        store.close()


@pytest.mark.parametrize("backend", COLLECTOR_BACKENDS)
def test_ten_requests_sent_as_sixteen_count_ten(collector_factory, tmp_path, backend):
    """The trial's case: 10 distinct requests, 6 of them resent (a lost acknowledgement), gave 16
    in /api/report, the overview and ``analyze report``."""
    bodies = _bodies(10)
    once = _start(collector_factory, backend, tmp_path, "once")
    for body in bodies:
        assert once.post(body, PROTOBUF).status_code == 200
    resent = _start(collector_factory, backend, tmp_path, "resent")
    for body in bodies + bodies[:6]:
        assert resent.post(body, PROTOBUF).status_code == 200
    expected = _views(once)
    got = _views(resent)
    assert (got["api"], got["overview"], got["cli"]) == (10, 10, 10)
    assert got["report"] == expected["report"]  # percentiles and categories too
    assert resent.health()["duplicate_spans"] == sum(map(_spans, bodies[:6]))
    assert once.stop() == 0 and resent.stop() == 0
    assert _tables(resent) == _tables(once)


@pytest.mark.parametrize("backend", COLLECTOR_BACKENDS)
def test_resends_as_spool_file_and_after_kill_9_store_nothing_twice(collector_factory, tmp_path, backend):
    """One delivery against: each batch 3x over HTTP (concurrently, so a writer group can hold two
    copies), then as spool files, then again to a collector restarted after kill -9."""
    bodies = _bodies(4)
    once = _start(collector_factory, backend, tmp_path, "once")
    for body in bodies:
        assert once.post(body, PROTOBUF).status_code == 200
    spool = tmp_path / "spool"
    spool.mkdir()
    resent = _start(collector_factory, backend, tmp_path, "resent", "--spool-dir", str(spool))
    statuses: list[int] = []
    threads = [threading.Thread(target=lambda b=body: statuses.append(resent.post(b, PROTOBUF).status_code))
               for body in bodies * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert statuses == [200] * 12
    for number, body in enumerate(bodies):
        (spool / f".{number}.tmp").write_bytes(body)
        os.replace(spool / f".{number}.tmp", spool / f"{number}.pb")
    wait_for(lambda: resent.health()["spool"]["ingested"] == 4, 60, "the spool files")
    resent.kill()
    restarted = collector_factory(store=resent.store, db=resent.db).start()
    for body in bodies:
        assert restarted.post(body, PROTOBUF).status_code == 200
    assert restarted.health()["duplicate_spans"] == sum(map(_spans, bodies))
    assert once.stop() == 0 and restarted.stop() == 0
    assert _tables(restarted) == _tables(once)


@pytest.mark.parametrize("backend", COLLECTOR_BACKENDS)
def test_kill_9_mid_stream_then_every_batch_resent_stores_each_span_once(collector_factory, tmp_path, backend):
    """A sender that lost its acknowledgements resends every batch it sent, acknowledged or not."""
    collector = _start(collector_factory, backend, tmp_path, "stream")
    sent: list[bytes] = []
    lock, stop = threading.Lock(), threading.Event()

    def send() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                body = make_request(20, name="stream").SerializeToString()
                with lock:
                    sent.append(body)
                try:
                    client.post(collector.url + "/v1/traces", content=body, headers={"Content-Type": PROTOBUF})
                except httpx.HTTPError:
                    return

    threads = [threading.Thread(target=send) for _ in range(4)]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(sent) >= 100, 120, "100 batches sent")
    collector.kill()
    stop.set()
    for thread in threads:
        thread.join(30)
    restarted = collector_factory(store=collector.store, db=collector.db).start()
    with httpx.Client(timeout=30) as client:
        for body in sent:
            response = client.post(restarted.url + "/v1/traces", content=body, headers={"Content-Type": PROTOBUF})
            assert response.status_code == 200
    assert restarted.stop() == 0
    spans = _tables(restarted)["spans"]
    assert len(spans) == len(set(spans)) == 20 * len(sent)
