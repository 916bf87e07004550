"""The engine's export path when the collector is away: a bounded spool of OTLP files."""

from __future__ import annotations

import http.server
import os
import threading
import time

import pytest
from harness_collector import free_port, wait_for
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tokentrace.engine_shim.emit.spool import STALE_CLAIM_S, Spool, SpoolingSpanExporter


def _spans(count: int = 3):
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    for i in range(count):
        tracer.start_span(f"span-{i}").end()
    return memory.get_finished_spans()


def test_spool_writes_whole_files_in_order_and_respects_its_limit(tmp_path):
    spool = Spool(tmp_path, max_bytes=100, name="engine/a b")
    assert spool.write(b"x" * 40) and spool.write(b"y" * 40)
    assert not spool.write(b"z" * 40)  # would exceed 100 bytes
    files = spool.files()
    assert [f.read_bytes()[:1] for f in files] == [b"x", b"y"]
    assert all(f.name.endswith(".pb") and "engine_a_b" in f.name for f in files)
    assert not list(tmp_path.glob("*.tmp"))


def test_claims_are_exclusive_and_stale_ones_come_back(tmp_path):
    spool = Spool(tmp_path, max_bytes=1000, name="a")
    spool.write(b"one")
    claimed = spool.claim()
    assert claimed.name.endswith(".pb.sending") and spool.claim() is None and spool.files() == []
    old = time.time() - STALE_CLAIM_S - 5
    os.utime(claimed, (old, old))
    assert len(Spool(tmp_path, max_bytes=1000, name="b").files()) == 1  # a new sender reclaims it


def test_unreachable_collector_spools_an_otlp_request_then_drops_when_full(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    exporter = SpoolingSpanExporter(url, Spool(tmp_path, max_bytes=2000, name="a"), timeout=0.5)
    try:
        assert exporter.export(_spans(3)) is SpanExportResult.SUCCESS
        (written,) = exporter.spool.files()
        request = ExportTraceServiceRequest.FromString(written.read_bytes())
        assert [s.name for s in request.resource_spans[0].scope_spans[0].spans] == ["span-0", "span-1", "span-2"]
        results = [exporter.export(_spans(5)) for _ in range(20)]
        assert SpanExportResult.FAILURE in results
        assert exporter.dropped_spans == 5 * results.count(SpanExportResult.FAILURE)
        assert exporter.spooled_batches == 1 + results.count(SpanExportResult.SUCCESS)
    finally:
        exporter.shutdown()


class _CountingSpool(Spool):
    """A spool that counts how often its directory is listed."""

    listings = 0

    def files(self):
        self.listings += 1
        return super().files()


def test_an_idle_sender_leaves_an_empty_spool_alone_until_a_batch_goes_there(tmp_path):
    """The resend thread listed the spool directory every retry interval, even empty and with the
    collector answering: 0.3 ms of CPU a second in every exporter process. It now looks once at
    start and again only after a batch was spooled, then every interval until the spool is empty."""
    spool = _CountingSpool(tmp_path, 1 << 20, "idle")
    exporter = SpoolingSpanExporter(f"http://127.0.0.1:{free_port()}", spool, timeout=0.2, retry_interval=0.02)
    try:
        wait_for(lambda: spool.listings >= 1, 10, "the first look at the spool")
        time.sleep(0.5)  # no event marks "nothing happened": 25 retry intervals, each of which used to list it
        assert spool.listings == 1
        assert exporter.export(_spans(1)) is SpanExportResult.SUCCESS  # spooled: nothing listens there
        listed = spool.listings
        wait_for(lambda: spool.listings >= listed + 3, 10, "the resend thread to retry the spooled batch")
    finally:
        exporter.shutdown()


class _Receiver(http.server.ThreadingHTTPServer):
    """An HTTP/1.1 receiver that counts connections and POSTs; with ``drop`` it closes each
    connection after answering without saying so, as a server whose idle timeout struck would."""

    def __init__(self, drop: bool):
        self.drop, self.connections, self.posts = drop, 0, 0
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                receiver.connections += 1
                super().setup()

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                receiver.posts += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                self.close_connection = receiver.drop

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.mark.parametrize("drop", [False, True], ids=["kept", "closed by the receiver"])
def test_batches_share_one_connection_and_one_the_receiver_closed_costs_no_batch(tmp_path, drop):
    receiver = _Receiver(drop)
    exporter = SpoolingSpanExporter(f"http://127.0.0.1:{receiver.server_address[1]}", Spool(tmp_path, 1 << 20, "k"))
    try:
        for _ in range(5):
            assert exporter.export_encoded(b"batch", 2)
    finally:
        exporter.shutdown()
        receiver.shutdown()
        receiver.server_close()
    assert (receiver.posts, exporter.exported_spans, exporter.spooled_batches) == (5, 10, 0)
    assert receiver.connections == (5 if drop else 1)


@pytest.mark.slow
def test_a_collector_watching_the_spool_ingests_it_exactly_once(tmp_path, collector_factory, engine_factory):
    collector = collector_factory()  # not started yet: its port refuses connections
    spool = tmp_path / "shared-spool"
    engine = engine_factory(collector=collector, spool_dir=spool).start()
    for i in range(3):
        assert engine.chat([{"role": "user", "content": f"hello {i}"}], max_tokens=2,
                           headers={"X-Request-Id": f"offline-{i}"}).status_code == 200
    wait_for(lambda: len(list(spool.glob("*.pb"))) >= 1, 30, "spooled batches")
    collector.args += ["--spool-dir", str(spool)]
    collector.start()  # the engine is still running: it must leave the files to the collector
    wait_for(lambda: not list(spool.glob("*.pb*")), 60, "the collector to ingest the spool")
    engine.stop()
    collector.stop()
    rows = collector.sql("SELECT request_id, count(*) FROM requests GROUP BY 1 ORDER BY 1")
    assert rows == [(f"offline-{i}", 1) for i in range(3)]
    assert list((spool / "ingested").glob("*.pb"))


def test_resent_files_carry_their_name(tmp_path, collector_factory):
    """Once the collector answers, the spooled file goes over HTTP with its name, and the collector
    records it like a file of its own spool directory (that the same bytes then count once is
    tests/test_spool.py's)."""
    collector = collector_factory()  # not started yet: its port refuses connections
    exporter = SpoolingSpanExporter(collector.url, Spool(tmp_path, max_bytes=100_000, name="a"), timeout=0.5,
                                    retry_interval=0.2)
    try:
        assert exporter.export(_spans(3)) is SpanExportResult.SUCCESS
        (spooled,) = exporter.spool.files()
        collector.start()
        wait_for(lambda: exporter.resent_batches == 1, 60, "the spooled file to be resent")
    finally:
        exporter.shutdown()
    assert collector.stop() == 0
    assert collector.sql("SELECT name, spans FROM spool_files") == [(spooled.name, 3)]
    assert collector.sql("SELECT count(*) FROM spans") == [(3,)]


@pytest.mark.slow
def test_spans_refused_for_a_wrong_token_wait_in_the_spool_and_arrive_after_a_restart_with_the_right_one(
        tmp_path, collector_factory, engine_factory):
    """Issue 12 §4: a collector answering 401 is up, not unreachable; the refused batches are not
    shelved as *.pb.rejected but delivered once an engine with the right token runs."""
    collector = collector_factory(token="right-token").start()
    spool = tmp_path / "spool"
    wrong = engine_factory(collector=collector, spool_dir=spool)
    assert wrong.args[-2:] == ["--otlp-token", "right-token"]
    wrong.args[-1] = "wrong-token"
    wrong.start()
    for i in range(2):
        assert wrong.chat([{"role": "user", "content": f"hi {i}"}], max_tokens=2,
                          headers={"X-Request-Id": f"refused-{i}"}).status_code == 200
    wait_for(lambda: "token missing or wrong (set --otlp-token)" in wrong.log_path.read_text(), 60,
             "the engine to say the token is wrong")
    assert wrong.stop() == 0
    log = wrong.log_path.read_text()
    assert "unreachable" not in log
    assert list(spool.glob("*.pb")) and not list(spool.glob("*.rejected"))

    right = engine_factory(collector=collector, spool_dir=spool, instance_id="engine-b").start()
    wait_for(lambda: not list(spool.glob("*.pb*")), 60, "the spooled batches to be delivered")
    assert right.stop() == 0
    assert collector.stop() == 0
    rows = collector.sql("SELECT request_id FROM requests WHERE request_id LIKE 'refused-%' ORDER BY 1")
    assert rows == [("refused-0",), ("refused-1",)]
