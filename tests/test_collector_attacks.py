"""Cheap attacks on the collector's budgets (issue 45), each against a real collector process.

Idle bodies: connections that declare a large Content-Length and send one byte held the whole
--max-pending-bytes budget for as long as they stayed open (no read timeout), and every other
sender got 503. Now a body must keep arriving (--body-timeout, --body-min-rate): the connections
are cut off with 408, their reservations given back, and a real sender's export goes through.
"""

from __future__ import annotations

import socket
import time

from harness_collector import wait_for
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

MIB = 1 << 20
BODY_TIMEOUT_S = 3


def _finished_spans(count: int, name: str):
    """``count`` spans ended by the real OpenTelemetry SDK, ready to export."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "victim"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("tokentrace.tests.attacks")
    for index in range(count):
        with tracer.start_as_current_span(name, attributes={"index": index}):
            pass
    provider.shutdown()
    return memory.get_finished_spans()


def _idle_body(port: int, declared: int) -> socket.socket:
    """A connection that declares ``declared`` body bytes and sends one."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-protobuf\r\n"
                 b"Content-Length: %d\r\n\r\n\n" % declared)
    return sock


def _answer(sock: socket.socket, timeout: float) -> bytes:
    """Everything the collector sends until it closes the connection (or ``timeout`` passes)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    return data


def test_idle_bodies_are_cut_off_and_other_senders_are_served(collector_factory):
    collector = collector_factory("--body-timeout", str(BODY_TIMEOUT_S)).start()
    limit = collector.health()["pending"]["limit_bytes"]
    declared = limit // (3 * 6)  # each request holds 6 x its declared size: three fill the budget
    idle = [_idle_body(collector.port, declared) for _ in range(3)]
    try:
        wait_for(lambda: collector.health()["pending"]["used_bytes"] == 3 * 6 * declared, 10,
                 "the idle bodies' reservations (the whole default budget of 256 MiB)")
        began = time.monotonic()
        exporter = OTLPSpanExporter(endpoint=collector.url + "/v1/traces", timeout=20)
        result = exporter.export(_finished_spans(50, "victim-span"))  # retries 503 as the SDK does
        exporter.shutdown()
        assert result is SpanExportResult.SUCCESS, "a real sender's export went through while the idle bodies waited"
        # Cut off within the timeout (+ 1 s for the byte each sent at 1 MiB/s, + scheduling slack).
        wait_for(lambda: collector.health()["pending"]["used_bytes"] == 0, BODY_TIMEOUT_S + 5,
                 "the budget given back")
        assert time.monotonic() - began < BODY_TIMEOUT_S + 8
        answers = [_answer(sock, 10) for sock in idle]
    finally:
        for sock in idle:
            sock.close()
    for answer in answers:
        head = answer.split(b"\r\n\r\n", 1)[0].lower()
        assert head.startswith(b"http/1.1 408"), answer[:200]
        assert b"connection: close" in head
        assert b"did not arrive in time" in answer
    health = collector.health()
    assert health["rejected"]["body_timeout"] == 3
    assert collector.stop() == 0
    assert collector.sql("SELECT count(*) FROM spans WHERE name = 'victim-span'") == [(50,)]
