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
