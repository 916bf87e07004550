"""Nothing acknowledged is ever lost: kill -9, clean stop, restart on the same file."""

from __future__ import annotations

import signal
import threading

import httpx
from harness_collector import CollectorProcess, wait_for
from test_collector_errors import make_request

SENDERS = 4


def _stream(collector: CollectorProcess, acked: list[str], stop: threading.Event) -> list[threading.Thread]:
    """Senders that post 20-span batches until stopped or the collector goes away."""

    def send() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                request = make_request(20, name="stream")
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


def test_kill_9_mid_stream_keeps_every_acknowledged_span(collector_factory):
    collector = collector_factory().start()
    acked: list[str] = []
    stop = threading.Event()
    threads = _stream(collector, acked, stop)
    wait_for(lambda: len(acked) >= 3000, 120, "3000 acknowledged spans")
    collector.kill()
    stop.set()
    for thread in threads:
        thread.join(30)
    snapshot = list(acked)
    restarted = collector_factory(db=collector.db).start()  # DuckDB replays its WAL on open
    assert restarted.health()["status"] == "ok"
    assert restarted.stop() == 0
    assert _stored(restarted, snapshot) == len(snapshot)


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
