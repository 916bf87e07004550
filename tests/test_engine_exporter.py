"""The exporter process and the telemetry thread: records leave the engine, failures never raise."""

from __future__ import annotations

import copy
import os
import signal
import time
from pathlib import Path

import pytest
from harness_collector import wait_for
from harness_engine import SchedulerHarness
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tokentrace import __version__
from tokentrace.engine_shim.emit import otlp_wire
from tokentrace.engine_shim.mlx.exporter_process import Batch, ExporterConfig, ExporterProcess
from tokentrace.engine_shim.mlx.records import Clock, EvictionRecord, HeartbeatRecord, LifecycleRecord
from tokentrace.engine_shim.mlx.spans import SpanBuilder
from tokentrace.engine_shim.mlx.telemetry import SCOPE, Telemetry

pytestmark = pytest.mark.slow


def _heartbeat(queue_depth: int = 0) -> HeartbeatRecord:
    return HeartbeatRecord(time.perf_counter_ns(), queue_depth, 0, 8, 0, 0, 16, 1 << 30, 512, 0)


def _spooled_span_names(directory) -> list[str]:
    names = []
    for path in sorted(directory.glob("*.pb")):
        request = ExportTraceServiceRequest.FromString(path.read_bytes())
        names += [s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    return names


def _config(tmp_path, port: int = 9) -> ExporterConfig:
    # Port 9 (discard) refuses connections here: every batch ends in the spool, where we can read it.
    return ExporterConfig({"service.instance.id": "exp-test"}, f"http://127.0.0.1:{port}", str(tmp_path), 1 << 20,
                          clock_offset_ns=Clock().offset_ns)


def test_records_become_spans_in_the_exporter_process(tmp_path):
    exporter = ExporterProcess(_config(tmp_path)).start()
    telemetry = Telemetry(exporter).start()
    telemetry.submit(LifecycleRecord("instance.started", time.perf_counter_ns()))
    telemetry.submit(_heartbeat(3))
    assert telemetry.flush(30)
    assert exporter.counters.built == 2
    if Path("/proc/self/comm").exists():  # the process carries its role in `ps` (core/threads.py)
        assert Path(f"/proc/{exporter.pid}/comm").read_text().strip() == "tt-exporter"
    telemetry.close()
    assert sorted(_spooled_span_names(tmp_path)) == ["instance.heartbeat", "instance.lifecycle"]
    assert exporter.pid is None  # stopped


def test_a_dead_exporter_process_is_restarted_and_losses_are_counted(tmp_path):
    exporter = ExporterProcess(_config(tmp_path)).start()
    telemetry = Telemetry(exporter).start()
    telemetry.submit(_heartbeat())
    assert telemetry.flush(30)
    os.kill(exporter.pid, signal.SIGKILL)
    wait_for(lambda: not exporter._process.is_alive(), 10, "the exporter process to die")
    for i in range(3):
        telemetry.submit(_heartbeat(i))
    assert telemetry.flush(30)
    assert exporter.restarts == 1 and exporter.dropped_records >= 1
    telemetry.close()


def test_a_failing_sink_or_heartbeat_never_raises():
    class Broken:
        def handle(self, record):
            raise RuntimeError("broken sink")

        def flush(self, timeout):
            raise RuntimeError("broken flush")

        def close(self, timeout):
            raise RuntimeError("broken close")

    def broken_heartbeat():
        raise RuntimeError("broken heartbeat")

    telemetry = Telemetry(Broken(), heartbeat=broken_heartbeat, heartbeat_interval=0.01).start()
    telemetry.submit(_heartbeat())
    assert telemetry.flush(5) is False
    wait_for(lambda: telemetry.errors >= 3, 10, "errors to be counted")
    telemetry.close()


class _Timed:
    """A sink that notes when it handled each record."""

    def __init__(self):
        import threading

        self.handled: list[tuple[object, float]] = []
        self.event = threading.Event()

    def handle(self, record):
        self.handled.append((record, time.monotonic()))
        self.event.set()

    def flush(self, timeout):
        return True

    def close(self, timeout):
        pass


def test_records_wait_while_a_prefill_runs_and_leave_once_it_has_its_first_token():
    from tokentrace.engine_shim.mlx.telemetry import PREFILL_HOLD_S

    sink = _Timed()
    telemetry = Telemetry(sink).start()
    try:
        telemetry.prefilling(True)
        telemetry.submit("record during a prefill")
        # Held: the hold lasts PREFILL_HOLD_S (0.25 s); a slow machine only makes "not yet" likelier.
        assert not sink.event.wait(PREFILL_HOLD_S / 3)
        opened = time.monotonic()
        telemetry.prefilling(False)
        assert sink.event.wait(10)
        assert sink.handled[0][0] == "record during a prefill" and sink.handled[0][1] >= opened
    finally:
        telemetry.close()


def test_a_held_record_leaves_after_the_hold_even_if_prefills_never_stop():
    from tokentrace.engine_shim.mlx.telemetry import PREFILL_HOLD_S

    sink = _Timed()
    telemetry = Telemetry(sink).start()
    try:
        telemetry.prefilling(True)  # and never False: a server with constant arrivals
        submitted = time.monotonic()
        for i in range(50):
            telemetry.submit(i)
        assert telemetry.flush(10)
        assert [r for r, _ in sink.handled] == list(range(50))
        # the first waited its hold; the others' holds ran at the same time, so no backlog builds up
        assert sink.handled[0][1] - submitted >= PREFILL_HOLD_S * 0.9
        assert sink.handled[-1][1] - submitted < 3.0  # one hold each would take 12.5 s
    finally:
        telemetry.close()


def _engine_records(model) -> list:
    """What a real scheduler records for three requests on a one-entry prompt cache (the second
    reuses the first's prefix; each insert evicts the entry before it), plus the same request
    failed with a 500 and with more evictions than a span may hold events, and a lifecycle event."""
    h = SchedulerHarness(model, max_batch=2, cache_max_entries=1)
    try:
        shared = [11 + i % 50 for i in range(40)]
        jobs = [h.submit("first", shared, max_tokens=5), h.submit("other", [7] * 30, max_tokens=3)]
        h.wait("first", "other")
        jobs.append(h.submit("follow-up", shared + [3] * 20, max_tokens=6))
        h.wait("follow-up")
    finally:
        h.stop()
    requests = [job.record for job in jobs]
    for record in requests:
        record.end_ns = record.finish_ns
    assert any(r.lookup and r.lookup.reused for r in requests) and any(r.insertion.evictions for r in requests)
    failed = copy.deepcopy(requests[-1])
    failed.request_id, failed.http_status, failed.finish_reason = "failed", 500, "error"
    failed.error_type = "GenerationError"
    evicted = failed.insertion.evictions[0]
    failed.insertion.evictions = [EvictionRecord(evicted.tokens, evicted.nbytes, f"r{i}", evicted.reason, 1, 2)
                                  for i in range(5)]
    return [*h.emitted, *requests, failed, LifecycleRecord("instance.started", time.perf_counter_ns())]


def _by_order(data: bytes) -> ExportTraceServiceRequest:
    """The request parsed, its trace and span ids replaced by their order of first appearance
    (each side draws random ids)."""
    request = ExportTraceServiceRequest.FromString(data)
    traces: dict[bytes, bytes] = {}
    spans: dict[bytes, bytes] = {}
    for scope_spans in request.resource_spans[0].scope_spans:
        for span in scope_spans.spans:
            span.trace_id = traces.setdefault(span.trace_id, len(traces).to_bytes(16, "big"))
            span.span_id = spans.setdefault(span.span_id, len(spans).to_bytes(8, "big"))
    for scope_spans in request.resource_spans[0].scope_spans:
        for span in scope_spans.spans:
            if span.parent_span_id:
                span.parent_span_id = spans[span.parent_span_id]
    return request


def test_the_exporter_process_writes_what_the_sdk_would_send(tiny_model):
    """The exporter process writes OTLP itself (otlp_wire); protobuf reads back, from the same
    real records, exactly what the OpenTelemetry SDK and its OTLP encoder produce: every span,
    attribute, event, status and dropped-event count, the resource and the scope."""
    records = _engine_records(tiny_model)
    resource = Resource.create({"service.instance.id": "wire-test", "tokentrace.observer.measures": ["ttft"]})
    clock = Clock()
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=resource, span_limits=SpanLimits(max_events=3))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    sdk_builder = SpanBuilder(provider.get_tracer(SCOPE, __version__), clock)
    wire: list[bytes] = []
    wire_builder = SpanBuilder(otlp_wire.WireTracer(wire.append, max_events=3), clock)
    for record in records:
        sdk_builder.build(record)
        wire_builder.build(record)
    sdk = _by_order(encode_spans(memory.get_finished_spans()).SerializeToString())
    ours = _by_order(otlp_wire.export_request(otlp_wire.resource_attributes(resource.attributes),
                                              otlp_wire.scope(SCOPE, __version__), wire))
    spans = ours.resource_spans[0].scope_spans[0].spans
    assert len(spans) > 30 and {s.name for s in spans} >= {
        "llm.request", "llm.cache.lookup", "llm.cache.insert", "llm.decode", "engine.steps", "model.load"}
    assert any(s.dropped_events_count == 2 for s in spans)  # five evictions, three kept
    assert any(s.status.code == 2 for s in spans)
    assert ours == sdk


def test_a_batch_leaves_whole_and_in_order(tmp_path):
    """Batch exports the oldest MAX_BATCH spans at a time, each span once."""
    from tokentrace.engine_shim.emit.spool import Spool, SpoolingSpanExporter
    from tokentrace.engine_shim.mlx import exporter_process

    exporter = SpoolingSpanExporter("http://127.0.0.1:9", Spool(tmp_path, 1 << 24, "batch-test"))
    batch = Batch(exporter, Resource.create({}), SCOPE, __version__)
    tracer = otlp_wire.WireTracer(batch.add)
    assert batch.due_in() is None
    for i in range(exporter_process.MAX_BATCH * 2 + 5):
        tracer.start_span(f"s{i}", start_time=i).end(i + 1)
    assert batch.due_in() == 0.0  # a full batch waits
    batch.send()
    assert exporter.spooled_batches == 1 and batch.due_in() == 0.0  # and another
    batch.send()
    assert exporter.spooled_batches == 2 and 0 < batch.due_in() <= exporter_process.EXPORT_DELAY_MS / 1000
    batch.send(everything=True)
    exporter.shutdown()
    assert exporter.spooled_batches == 3 and batch.due_in() is None
    names = _spooled_span_names(tmp_path)
    assert names == [f"s{i}" for i in range(exporter_process.MAX_BATCH * 2 + 5)]


def test_spans_left_after_a_full_batch_keep_their_age(tmp_path):
    """A span that ended 0.3 s ago and did not fit in the full batch that just left is due 0.2 s
    later (EXPORT_DELAY_MS after it ended), not a whole delay after that batch left."""
    from tokentrace.engine_shim.emit.spool import Spool, SpoolingSpanExporter
    from tokentrace.engine_shim.mlx import exporter_process

    exporter = SpoolingSpanExporter("http://127.0.0.1:9", Spool(tmp_path, 1 << 24, "age-test"))
    batch = Batch(exporter, Resource.create({}), SCOPE, __version__)
    tracer = otlp_wire.WireTracer(batch.add)
    for i in range(exporter_process.MAX_BATCH + 3):
        tracer.start_span(f"s{i}", start_time=i).end(i + 1)
    ended = time.monotonic()  # the last three ended before this
    while time.monotonic() < ended + 0.3:  # the spans' age is what is tested: let it grow
        time.sleep(0.3 - (time.monotonic() - ended))
    batch.send()
    assert exporter.spooled_batches == 1
    assert batch.due_in() <= exporter_process.EXPORT_DELAY_MS / 1000 - 0.3
    batch.send(everything=True)
    exporter.shutdown()
    assert batch.due_in() is None
    assert _spooled_span_names(tmp_path) == [f"s{i}" for i in range(exporter_process.MAX_BATCH + 3)]


def test_attributes_of_every_kind_read_back_as_the_sdk_encoder_writes_them():
    """otlpwire.c against the OTLP encoder of the OpenTelemetry SDK, value by value: lengths that
    take one, two and three varint bytes, negative and extreme ints, floats, bytes, arrays."""
    from opentelemetry.exporter.otlp.proto.common._internal import _encode_attributes
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    from tokentrace.engine_shim.emit._otlpwire import attributes

    values = {
        "empty": "", "text": "grüße, 你好", "long": "x" * 200, "longer": "y" * 20_000, "yes": True, "no": False,
        "zero": 0, "minus": -1, "big": 2**63 - 1, "small": -(2**63), "mid": 300, "half": 1.5, "inf": float("inf"),
        "negative zero": -0.0, "raw": b"\x00\xff", "ints": [0, 1, 127, 128, 16_384, -5, 2**62], "names": ["a", "b"],
        "floats": (0.25, -3.0), "flags": [True, False], "none of them": [], "holes": [1, None, 3], "left out": None,
        "many": list(range(5000)),
    }
    ours = Span.FromString(attributes(0x4A, values)).attributes
    assert list(ours) == _encode_attributes({k: v for k, v in values.items() if v is not None})
    for bad, error in (({"nested": [[1]]}, TypeError), ({"huge": 2**63}, OverflowError), ({1: "x"}, TypeError),
                       ({"object": object()}, TypeError), ({"set": {1}}, TypeError)):
        with pytest.raises(error, match=r"attribute|keys"):
            attributes(0x4A, bad)
