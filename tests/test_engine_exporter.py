"""The exporter process and the telemetry thread: records leave the engine, failures never raise."""

from __future__ import annotations

import os
import signal
import time

import pytest
from harness_collector import wait_for
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace.engine_shim.mlx.exporter_process import ExporterConfig, ExporterProcess
from tokentrace.engine_shim.mlx.records import Clock, HeartbeatRecord, LifecycleRecord
from tokentrace.engine_shim.mlx.telemetry import Telemetry

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
