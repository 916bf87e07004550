"""Nothing acknowledged is ever lost: kill -9, clean stop, restart on the same file."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from harness_collector import CollectorProcess, wait_for
from test_collector_errors import make_request

SENDERS = 4


def _stream(collector: CollectorProcess, acked: list[str], stop: threading.Event,
            spans: int = 20) -> list[threading.Thread]:
    """Senders that post batches of ``spans`` spans until stopped or the collector goes away."""

    def send() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                request = make_request(spans, name="stream")
                ids = [span.span_id.hex() for span in request.resource_spans[0].scope_spans[0].spans]
                try:
                    response = client.post(collector.url + "/v1/traces", content=request.SerializeToString(),
                                           headers={"Content-Type": "application/x-protobuf"})
                except httpx.HTTPError:
                    return
                if response.status_code == 200:
                    acked.extend(ids)

    threads = [threading.Thread(target=send) for _ in range(SENDERS)]
    for thread in threads:
        thread.start()
    return threads


def _stored(collector: CollectorProcess, span_ids: list[str]) -> int:
    [(count,)] = collector.sql("SELECT count(DISTINCT span_id) FROM spans WHERE span_id IN (SELECT unnest(?))",
                               [span_ids])
    return count


def kill_mid_stream(collector: CollectorProcess, spans: int, batch: int = 20,
                    ready: Callable[[], bool] = lambda: True, what: str = "") -> list[str]:
    """Stream batches of ``batch`` spans to ``collector``, kill -9 it once ``spans`` are acknowledged
    and ``ready()`` (``what`` it waits for); the acknowledged ids."""
    acked: list[str] = []
    stop = threading.Event()
    threads = _stream(collector, acked, stop, batch)
    wait_for(lambda: len(acked) >= spans and ready(), 120, what or f"{spans} acknowledged spans")
    collector.kill()
    stop.set()
    for thread in threads:
        thread.join(30)
    return list(acked)


@pytest.mark.parametrize("parser", ["decoder", "normalizer"])
def test_kill_9_mid_stream_keeps_every_acknowledged_span(collector_factory, monkeypatch, parser):
    """Killed while batches stream in: every acknowledged span is stored after a restart (its
    journal appended). With the compiled decoder the payloads are parsed in the collector's process;
    with it off (TOKENTRACE_FASTPATH=0) in its worker, which must exit once its collector is gone."""
    if parser == "normalizer":
        monkeypatch.setenv("TOKENTRACE_FASTPATH", "0")  # the collector process inherits it
    collector = collector_factory("--parse-workers", "1").start()
    assert collector.post(make_request(3).SerializeToString(), "application/x-protobuf").status_code == 200
    workers = _parse_workers(collector.proc.pid)  # the pool starts its workers on demand
    assert bool(workers) == (parser == "normalizer")
    snapshot = kill_mid_stream(collector, 3000)
    # Orphaned parse workers notice their collector is gone and exit.
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 30, "the orphaned workers to exit")
    monkeypatch.delenv("TOKENTRACE_FASTPATH", raising=False)
    restarted = collector_factory(db=collector.db).start()  # appends its journal, DuckDB replays its WAL
    assert restarted.health()["status"] == "ok"
    assert restarted.stop() == 0
    assert _stored(restarted, snapshot) == len(snapshot)


def test_kill_9_while_merges_write_span_files_keeps_every_acknowledged_span_once(collector_factory):
    """Merges large enough to write their spans to Parquet files (collector/stores/span_files.py): killed
    once some are listed, with more being written, the restarted collector has every acknowledged
    span once, and its folder holds exactly the files its store lists (a file written but not listed
    when the kill came is deleted, its batches appended again from the journal)."""
    collector = collector_factory().start()
    snapshot = kill_mid_stream(collector, 1, batch=400, what="two span files",
                               ready=lambda: collector.health()["journal"]["span_files"]["files"] >= 2)
    restarted = collector_factory(db=collector.db).start()
    assert restarted.stop() == 0
    assert _stored(restarted, snapshot) == len(snapshot)
    [(rows, distinct)] = restarted.sql("SELECT count(*), count(DISTINCT span_id) FROM spans")
    assert rows == distinct >= len(snapshot)
    listed = sorted(name for (name,) in restarted.sql("SELECT name FROM span_files"))
    assert listed and listed == sorted(p.name for p in Path(str(collector.db) + ".spans").iterdir())


def test_sigterm_mid_stream_exits_0_and_checkpoints_everything_acknowledged(collector_factory):
    collector = collector_factory().start()
    acked: list[str] = []
    stop = threading.Event()
    threads = _stream(collector, acked, stop)
    wait_for(lambda: len(acked) >= 1000, 120, "1000 acknowledged spans")
    assert collector.stop(signal.SIGTERM) == 0
    stop.set()
    for thread in threads:
        thread.join(30)
    assert _stored(collector, list(acked)) == len(acked)
    wal = collector.db.with_name(collector.db.name + ".wal")
    assert not wal.exists() or wal.stat().st_size == 0, "a clean stop checkpoints the store"


def _children(pid: int) -> list[int]:
    """Child process ids of ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _parse_workers(pid: int) -> list[int]:
    return [child for child in _children(pid)
            if "spawn_main" in Path(f"/proc/{child}/cmdline").read_text(errors="replace")]


def test_a_killed_parse_worker_costs_no_request(collector_factory, monkeypatch):
    monkeypatch.setenv("TOKENTRACE_FASTPATH", "0")  # every payload to the worker (the normalizer's path)
    collector = collector_factory("--parse-workers", "1").start()
    assert collector.post(make_request(3).SerializeToString(), "application/x-protobuf").status_code == 200
    workers = _parse_workers(collector.proc.pid)
    assert workers, "the collector runs its parse worker as a child process"
    assert {Path(f"/proc/{pid}/comm").read_text().strip() for pid in workers} == {"tt-parse"}  # in `ps`
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    for _ in range(5):
        assert collector.post(make_request(3).SerializeToString(), "application/x-protobuf").status_code == 200
    assert collector.stop() == 0
    assert collector.sql("SELECT count(*) FROM spans") == [(18,)]


def test_parsing_in_the_collector_process_stores_the_same(collector_factory):
    collector = collector_factory("--parse-workers", "0").start()
    for _ in range(3):
        assert collector.post(make_request(4).SerializeToString(), "application/x-protobuf").status_code == 200
    assert collector.health()["accepted_spans"] == 12
    assert collector.stop() == 0
    assert collector.sql("SELECT count(*) FROM spans") == [(12,)]
