"""Cheap attacks on the collector's budgets (issue 45), each against a real collector process.

Amplification: every span row carries a copy of its resource's attributes, so a body of 150 kB
became 100 MB of columns; bodies like it took the collector's memory far past its budget, and a
batch of them acknowledged wedged every merge of a store with little memory, at every start. Now
such a body is refused with 413 before it is decoded, and a batch the store cannot take is
quarantined instead of replayed into the same wall.

Idle bodies: connections that declare a large Content-Length and send one byte held the whole
--max-pending-bytes budget for as long as they stayed open (no read timeout), and every other
sender got 503. Now a body must keep arriving (--body-timeout, --body-min-rate): the connections
are cut off with 408, their reservations given back, and a real sender's export goes through.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from pathlib import Path

from harness_collector import proc_status, wait_for
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_collector_errors import make_request

from tokentrace.collector.stores.journal import Log

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
        # Cut off at the deadline, or before it once the victim's retry took its reservation.
        assert b"did not arrive in time" in answer or b"its reservation went to a request waiting" in answer
    health = collector.health()
    assert health["rejected"]["body_timeout"] == 3
    assert collector.stop() == 0
    assert collector.sql("SELECT count(*) FROM spans WHERE name = 'victim-span'") == [(50,)]


def test_idle_bodies_that_reconnect_when_cut_off_do_not_shut_out_other_senders(collector_factory):
    """Three connections that each declare a third of the budget, send one byte and reconnect as soon
    as they are cut off held the budget again within milliseconds, before a sender waiting out its
    Retry-After came back: bench/attacks.py's honest sender got none of 10 tries through. Now a
    body arriving slower than --body-min-rate gives its reservation up to a request that finds the
    budget full."""
    collector = collector_factory("--body-timeout", str(BODY_TIMEOUT_S)).start()
    limit = collector.health()["pending"]["limit_bytes"]
    declared = limit // (3 * 6)
    stop, cut_off = threading.Event(), []

    def attacker() -> None:
        while not stop.is_set():
            sock = _idle_body(collector.port, declared)
            try:
                cut_off.append(_answer(sock, 30).split(b"\r\n", 1)[0])
            finally:
                sock.close()

    attackers = [threading.Thread(target=attacker) for _ in range(3)]
    for thread in attackers:
        thread.start()
    accepted, refused = 0, 0
    try:
        wait_for(lambda: collector.health()["pending"]["used_bytes"] == 3 * 6 * declared, 10,
                 "the idle bodies' reservations (the whole budget)")
        deadline = time.monotonic() + 4 * BODY_TIMEOUT_S
        while time.monotonic() < deadline:
            body = make_request(20, name="honest").SerializeToString()
            answer = collector.post(body, "application/x-protobuf")
            if answer.status_code == 200:
                accepted += 1
                time.sleep(0.1)
            else:
                assert answer.status_code == 503, answer.text
                refused += 1
                time.sleep(float(answer.headers["Retry-After"]))
    finally:
        stop.set()
        for thread in attackers:
            thread.join(BODY_TIMEOUT_S + 10)
    health = collector.health()
    print(f"honest sender: {accepted} accepted, {refused} refused; attackers cut off {len(cut_off)} times; "
          f"{health['pending'].get('slow_bodies_evicted')} reservations given up")
    assert accepted >= 4, f"{accepted} accepted, {refused} refused in {4 * BODY_TIMEOUT_S} s"
    assert health["pending"]["slow_bodies_evicted"] >= 1
    # Cut off (408), or refused when the budget was taken (503) by the time they came back.
    assert cut_off and {line.split()[1] for line in cut_off} <= {b"408", b"503"}, set(cut_off)
    assert b"408" in {line.split()[1] for line in cut_off}
    wait_for(lambda: collector.health()["pending"]["used_bytes"] == 0, 10, "the budget given back")
    assert collector.stop() == 0
    assert collector.sql("SELECT count(*) FROM spans WHERE name = 'honest'") == [(20 * accepted,)]


# --- amplification ---------------------------------------------------------------------------------
BUDGET = 32 * MIB
STORE_MEMORY = 16 * MIB


def amplifying_body(resource_bytes: int, spans: int, name: str = "amplified") -> bytes:
    """A small body whose spans each carry a copy of ``resource_bytes`` of resource attributes: 1,000
    spans under 100 kB of attributes are a 153 kB body that becomes 100 MB of columns."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    for index in range(max(1, resource_bytes // 50_000)):
        resource_spans.resource.attributes.add(key=f"pad{index}").value.string_value = "r" * 50_000
    scope = resource_spans.scope_spans.add()
    for index in range(spans):
        scope.spans.add(name=name, trace_id=os.urandom(16), span_id=os.urandom(8),
                        start_time_unix_nano=1_700_000_000_000_000_000 + index,
                        end_time_unix_nano=1_700_000_000_000_000_001 + index)
    return request.SerializeToString()


def test_an_amplifying_body_is_refused_and_memory_stays_bounded(collector_factory):
    collector = collector_factory("--max-pending-bytes", str(BUDGET), "--store-memory-bytes", str(STORE_MEMORY),
                                  "--parse-workers", "0").start()
    assert collector.post(make_request(200, name="warm").SerializeToString(),
                          "application/x-protobuf").status_code == 200
    idle = proc_status(collector.proc.pid, "VmRSS")
    body = amplifying_body(100_000, 1000)
    answers, victims = [], []

    def attack() -> None:
        answers.append(collector.post(body, "application/x-protobuf"))

    def victim() -> None:
        victims.append(collector.post(make_request(500, name="victim").SerializeToString(), "application/x-protobuf"))

    threads = [threading.Thread(target=attack) for _ in range(2)] + [threading.Thread(target=victim)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    peak = proc_status(collector.proc.pid, "VmHWM")
    print(f"amplifying bodies of {len(body)} bytes: peak RSS {peak / MIB:.0f} MiB, idle {idle / MIB:.0f} MiB, "
          f"(peak - idle) / budget = {(peak - idle) / BUDGET:.2f} "
          f"(bound: 2 + store memory {STORE_MEMORY / BUDGET:.2f})")
    for answer in answers:
        assert answer.status_code == 413, answer.content[:300]
        assert "resource" in answer.text and "bytes of columns" in answer.text, answer.text
    assert [victim.status_code for victim in victims] == [200], "another sender is served meanwhile"
    health = collector.health()
    assert health["status"] == "ok", health["problems"]
    assert peak - idle <= 2 * BUDGET + STORE_MEMORY, f"peak RSS {peak / MIB:.0f} MiB, idle {idle / MIB:.0f} MiB"
    assert collector.stop() == 0
    assert collector.sql("SELECT count(*) FROM spans WHERE name = 'victim'") == [(500,)]


def _journal_record(db: Path, seq: int, body: bytes) -> None:
    """Append ``body`` to the store's journal as an acknowledged protobuf batch, as a collector before
    issue 45 journaled an amplifying body it acknowledged (store_duckdb._record's layout)."""
    head = json.dumps({"spool": None, "parts": [["protobuf", 65536, len(body)]]}).encode()
    Log(Path(str(db) + ".journal")).append(seq, [struct.pack("<I", len(head)), head, body])


def test_a_batch_the_store_cannot_take_is_quarantined_not_replayed_at_every_start(collector_factory):
    args = ("--store-memory-bytes", str(STORE_MEMORY), "--max-pending-bytes", str(BUDGET))
    first = collector_factory(*args).start()
    assert first.stop() == 0
    # 100 MB of span rows: DuckDB, at 16 MiB, fails every merge ("failed to pin block"), at every start.
    _journal_record(first.db, 1, amplifying_body(100_000, 1000))
    collector = collector_factory(*args).start(timeout=120)
    health = collector.health()
    quarantine = health["journal"]["quarantine"]
    assert quarantine["entries"] == 1, quarantine
    [entry] = quarantine["latest"]
    assert entry["seq"] == 1 and entry["spans"] == 1000 and entry["acknowledged_batches_lost"] is True
    assert "pin block" in entry["why"] or "memory" in entry["why"].lower(), entry["why"]
    assert Path(entry["file"]).stat().st_size > 150_000, "the record is kept as it was journaled"
    assert collector.post(make_request(300, name="after").SerializeToString(),
                          "application/x-protobuf").status_code == 200
    assert "quarantined journal record the store cannot take" in collector.log_path.read_text()
    assert collector.stop() == 0
    again = collector_factory(*args).start(timeout=30)  # not replayed into the same wall
    assert again.health()["journal"]["quarantine"]["entries"] == 1
    assert again.stop() == 0
    assert again.sql("SELECT count(*) FROM spans WHERE name = 'after'") == [(300,)]
    assert again.sql("SELECT count(*) FROM spans WHERE name = 'amplified'") == [(0,)]
