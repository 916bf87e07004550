"""A separate process that turns the engine's finished records into spans and exports them.

Why a process: turning records into OTLP costs Python time per array element (the engine.steps
columns and decode offsets hold a few per generated token). On a thread, that CPU competes with
the generation thread for the GIL: measured 2-4 % slower decode on the tiny model. In a process of
its own it runs on another core; the engine only pickles plain records (lists of ints), about 1 µs
per token.

Why not the SDK in that process: on a 2-core machine the engine keeps both cores busy in decode,
so the exporter's CPU still comes off decode. Building SDK spans and encoding them cost 40-45 µs a
token of the 55-147 measured; the process now writes the same spans straight to OTLP protobuf
(``tokentrace.engine_shim.emit.otlp_wire``) and batches them itself: a batch leaves when its first
span is ``EXPORT_DELAY_MS`` old or when it holds ``MAX_BATCH`` spans, one HTTP post each on a kept
connection, with the spool behind it. One thread builds and sends; the spool's resend thread sleeps
unless the spool holds something.

The parent sends records over a ``multiprocessing`` pipe (spawn context: nothing of the engine's
MLX state is inherited). The child answers flush and stop requests with its export counters. If
the child dies, records are counted as dropped and it is restarted. A stop signalled to the whole
process group (``systemctl stop``, Ctrl-C) does not end the child: the engine stops it in order,
after handing it its last records (``_StopSignals``; issue 44).

The SDK wiring (``build_tracer_provider``, ``engine_resource``) is what embedders and the benchmark
use. It is never called on import and never installs a global provider (STYLE §9).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from tokentrace import contract as c
from tokentrace.engine_shim.emit import otlp_wire
from tokentrace.engine_shim.emit.spool import Spool, SpoolingSpanExporter
from tokentrace.hardware import chip_name
from tokentrace.threads import name_os_thread

log = logging.getLogger(__name__)

#: Restarts allowed after the exporter process died, per engine process.
MAX_RESTARTS = 3

#: Batches leave twice a second, so a collector sees a finished request within about a second.
EXPORT_DELAY_MS = 500
#: Finished spans an embedder's batch processor may hold; a request is ~10 spans.
EXPORT_QUEUE = 32768
#: Spans in one export request at most.
MAX_BATCH = 512
#: An insert can evict many entries at once; each eviction is an event.
MAX_EVENTS = 4096
#: Signals that stop an engine; the exporter process handles them itself (``_StopSignals``).
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def engine_resource(instance_id: str, model: str, service_name: str = "tokentrace-engine",
                    model_dir: str | None = None, chat_template: str | None = None,
                    memory_bandwidth_gbs: float | None = None) -> Resource:
    """The contract's resource attributes for an mlx-lm engine instance: it measures every request
    part, and names the weights (``model_dir``) and chat template (``chat_template``, else the
    model's own) it serves with, when it can read them; the chip where macOS names it, and the
    declared peak memory bandwidth (``memory_bandwidth_gbs``) when given."""
    try:
        from mlx_lm import __version__ as engine_version
    except ImportError:  # pragma: no cover - the engine needs mlx-lm anyway
        engine_version = "unknown"
    attributes = {
        c.SERVICE_NAME: service_name,
        c.SERVICE_INSTANCE_ID: instance_id,
        c.HOST_NAME: socket.gethostname(),
        c.ENGINE: c.ENGINE_MLX,
        c.ENGINE_VERSION: engine_version,
        c.MODEL: model,
        c.OBSERVER_MEASURES: list(c.OBSERVER_PARTS),
    }
    if chip := chip_name():
        attributes[c.HOST_CHIP] = chip
    if memory_bandwidth_gbs:
        attributes[c.HOST_MEMORY_BANDWIDTH_GBS] = float(memory_bandwidth_gbs)
    if model_dir is not None:
        attributes.update(model_identity(Path(model_dir), chat_template))
    return Resource.create(attributes)


def model_identity(directory: Path, chat_template: str | None = None) -> dict[str, str]:
    """``tokentrace.model.revision`` (config.json, and each weight file's name and size) and
    ``tokentrace.chat_template.hash`` (the template given, else tokenizer_config.json's or
    chat_template.jinja's), each the first 16 hex digits of a SHA-256 (docs/telemetry.md); a part
    that cannot be read (a hub id not yet downloaded) is left out."""
    identity: dict[str, str] = {}
    config = directory / "config.json"
    if config.is_file():
        digest = hashlib.sha256(config.read_bytes())
        for weights in sorted(directory.glob("*.safetensors")):
            digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
        identity[c.MODEL_REVISION] = digest.hexdigest()[:16]
    if chat_template is None:
        jinja, tokenizer_config = directory / "chat_template.jinja", directory / "tokenizer_config.json"
        if jinja.is_file():
            chat_template = jinja.read_text(encoding="utf-8")
        elif tokenizer_config.is_file():
            template = json.loads(tokenizer_config.read_text(encoding="utf-8")).get("chat_template")
            chat_template = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    if chat_template is not None:
        identity[c.CHAT_TEMPLATE_HASH] = hashlib.sha256(chat_template.encode()).hexdigest()[:16]
    return identity


def build_tracer_provider(
    resource: Resource, endpoint: str | None, spool_dir: str | None, spool_max_bytes: int, token: str | None = None,
) -> tuple[TracerProvider, SpoolingSpanExporter]:
    """A provider exporting OTLP/HTTP protobuf to ``endpoint`` with a spool behind it."""
    name = str(resource.attributes.get(c.SERVICE_INSTANCE_ID, "engine"))
    spool = Spool(spool_dir, spool_max_bytes, name) if spool_dir else None
    exporter = SpoolingSpanExporter(endpoint or None, spool, token=token)
    provider = TracerProvider(resource=resource, span_limits=SpanLimits(max_events=MAX_EVENTS))
    provider.add_span_processor(BatchSpanProcessor(
        exporter, schedule_delay_millis=EXPORT_DELAY_MS, max_queue_size=EXPORT_QUEUE, max_export_batch_size=MAX_BATCH))
    return provider, exporter


@dataclass(frozen=True)
class ExporterConfig:
    """What the exporter process needs to wire its SDK."""

    resource: dict[str, str | list[str]]  #: resource attributes (service.instance.id, ...)
    endpoint: str | None  #: collector base URL; None or '' disables export
    spool_dir: str | None  #: spool directory; None disables spooling
    spool_max_bytes: int  #: spool size limit
    token: str | None = None  #: collector bearer token
    clock_offset_ns: int = 0  #: the engine's perf_counter -> epoch offset


@dataclass(frozen=True)
class Control:
    """A request to the exporter process: flush or stop; it answers with its counters."""

    kind: str  #: "flush" or "stop"
    timeout: float = 10.0  #: seconds the child may spend flushing


@dataclass
class ExportCounters:
    """How the exporter process fared (reported on flush and stop)."""

    built: int = 0  #: records turned into spans
    build_errors: int = 0  #: records that failed to build
    exported_spans: int = 0  #: spans the collector acknowledged directly
    spooled_batches: int = 0  #: batches written to the spool
    resent_batches: int = 0  #: spooled batches delivered later
    dropped_spans: int = 0  #: spans lost (spool full or unavailable)
    extra: dict[str, int] = field(default_factory=dict)  #: anything else worth reporting


class ExporterProcess:
    """The parent's handle on the exporter process; a ``RecordSink`` for ``Telemetry``.

    ``handle``, ``flush`` and ``close`` are called from the telemetry thread only (``close`` after
    that thread stopped), so the pipe has a single user.
    """

    def __init__(self, config: ExporterConfig):
        self.config = config
        self.dropped_records = 0  #: records lost because the exporter process was gone
        self.restarts = 0  #: times the exporter process was restarted
        self.counters = ExportCounters()  #: the child's last report
        self._context = multiprocessing.get_context("spawn")
        self._process: Any = None
        self._conn: Any = None

    def start(self) -> ExporterProcess:
        """Spawn the process (it imports only the OpenTelemetry SDK and tokentrace, not mlx)."""
        parent, child = self._context.Pipe(duplex=True)
        self._process = self._context.Process(target=serve, args=(child, self.config), name="tokentrace-exporter",
                                              daemon=True)
        with _stop_signals_ignored():
            self._process.start()
        child.close()
        self._conn = parent
        return self

    @property
    def pid(self) -> int | None:
        """Process id of the exporter process."""
        return self._process.pid if self._process is not None else None

    def handle(self, record: Any) -> None:
        """Send one record (pickled on this thread)."""
        if self._conn is None:
            self.start()
        try:
            self._conn.send(record)
        except (OSError, EOFError, ValueError):
            self.dropped_records += 1
            self._restart()

    def flush(self, timeout: float) -> bool:
        """Ask the child to export everything it has; True once it confirms."""
        return self._ask(Control("flush", timeout), timeout)

    def close(self, timeout: float) -> None:
        """Stop the child after it flushed; keeps its final counters."""
        if self._process is None:
            return
        self._ask(Control("stop", timeout), timeout)
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.terminate()  # a second SIGTERM when the group had one: it spools and leaves
            self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._conn.close()
        self._process = self._conn = None

    def _ask(self, control: Control, timeout: float) -> bool:
        if self._conn is None:
            return False
        try:
            self._conn.send(control)
            if not self._conn.poll(timeout + 1):
                return False
            self.counters = self._conn.recv()
            return True
        except (OSError, EOFError, ValueError):
            return False

    def _restart(self) -> None:
        if self._process is not None and self._process.is_alive():
            return  # a transient error; the process is still there
        if self.restarts >= MAX_RESTARTS:
            if self.restarts == MAX_RESTARTS:
                log.error("the exporter process died %d times; spans are dropped from now on", self.restarts + 1)
                self.restarts += 1
            return
        self.restarts += 1
        log.warning("the exporter process died; restarting it (%d of %d)", self.restarts, MAX_RESTARTS)
        self.start()


@contextlib.contextmanager
def _stop_signals_ignored() -> Iterator[None]:
    """Spawn with SIGINT and SIGTERM ignored (an ignored signal stays ignored across exec; a
    blocked one does not, with multiprocessing's spawn), so that the exporter process is immune
    from its first instruction until ``serve`` handles them: a stop signalled to the group while
    it still imported killed it, with every record the engine had handed it (seen on a busy host).
    Meanwhile this thread blocks them, so that one sent to the engine then waits (Linux never
    discards a blocked signal) for the handler put back after. Only the main thread can change
    handlers; a restart from the telemetry thread spawns as before."""
    handlers = {number: signal.getsignal(number) for number in _STOP_SIGNALS}
    if threading.current_thread() is not threading.main_thread() or None in handlers.values():
        yield
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        for number in _STOP_SIGNALS:
            signal.signal(number, signal.SIG_IGN)
        yield
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class Batch:
    """Spans written but not yet exported; ``send`` exports up to ``MAX_BATCH`` of them as one request."""

    def __init__(self, exporter: SpoolingSpanExporter, resource: Resource, scope_name: str, scope_version: str):
        self.exporter = exporter
        self._resource = otlp_wire.resource_attributes(resource.attributes)
        self._scope = otlp_wire.scope(scope_name, scope_version)
        self._spans: list[bytes] = []
        #: Monotonic time each batch to come began: the first span of each ``MAX_BATCH`` pending.
        #: Spans left over after a full batch left keep their age (they once restarted the clock, so
        #: they could wait up to twice ``EXPORT_DELAY_MS``).
        self._began: deque[float] = deque()

    def add(self, span: bytes) -> None:
        """One ended span (``WireTracer``'s ``on_end``)."""
        if len(self._spans) % MAX_BATCH == 0:
            self._began.append(time.monotonic())
        self._spans.append(span)

    def due_in(self) -> float | None:
        """Seconds until the pending spans are due (0 when a full batch waits); None when none are."""
        if not self._spans:
            return None
        if len(self._spans) >= MAX_BATCH:
            return 0.0
        return max(0.0, self._began[0] + EXPORT_DELAY_MS / 1000 - time.monotonic())

    def send(self, everything: bool = False) -> None:
        """Export the oldest ``MAX_BATCH`` pending spans (all of them, batch by batch, with ``everything``)."""
        while self._spans:
            spans, self._spans = self._spans[:MAX_BATCH], self._spans[MAX_BATCH:]
            self._began.popleft()
            self.exporter.export_encoded(otlp_wire.export_request(self._resource, self._scope, spans), len(spans))
            if not everything:
                return


def serve(conn: Any, config: ExporterConfig) -> None:
    """The exporter process: records in, spans out, until told to stop or the engine is gone."""
    from tokentrace import __version__
    from tokentrace.engine_shim.mlx.records import Clock
    from tokentrace.engine_shim.mlx.spans import SpanBuilder
    from tokentrace.engine_shim.mlx.telemetry import SCOPE

    stopping = _StopSignals()
    name_os_thread("tokentrace-exporter")  # `ps` and `top` show the process as tt-exporter
    # When cores are scarce, generation goes first: spans can wait a little, tokens should not.
    with contextlib.suppress(OSError, AttributeError):
        os.nice(10)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    resource = Resource.create(config.resource)
    name = str(resource.attributes.get(c.SERVICE_INSTANCE_ID, "engine"))
    spool = Spool(config.spool_dir, config.spool_max_bytes, name) if config.spool_dir else None
    exporter = SpoolingSpanExporter(config.endpoint or None, spool, token=config.token)
    batch = Batch(exporter, resource, SCOPE, __version__)
    builder = SpanBuilder(otlp_wire.WireTracer(batch.add, MAX_EVENTS), Clock(config.clock_offset_ns))
    counters = ExportCounters()

    def report() -> ExportCounters:
        counters.exported_spans = exporter.exported_spans
        counters.spooled_batches = exporter.spooled_batches
        counters.resent_batches = exporter.resent_batches
        counters.dropped_spans = exporter.dropped_spans
        return counters

    while True:
        due = batch.due_in()
        if stopping.terms and due is not None:
            due = 0.0  # the engine is stopping: what arrives leaves as soon as the pipe is empty
        try:
            ready = stopping.wait(conn, due)
            if stopping.terms > 1:  # told twice (the engine's last resort): leave now
                message = Control("stop")
            elif conn not in ready:
                if due is not None and batch.due_in() is not None:
                    batch.send(everything=bool(stopping.terms))
                continue
            else:
                message = conn.recv()
        except (EOFError, OSError):  # the engine is gone: export what we have and leave
            message = Control("stop")
        if isinstance(message, Control):
            batch.send(everything=True)
            if message.kind == "stop":
                exporter.shutdown()
            with contextlib.suppress(OSError, ValueError):
                conn.send(report())
            if message.kind == "stop":
                return
            continue
        try:
            builder.build(message)
            counters.built += 1
        except Exception:
            counters.build_errors += 1
            if counters.build_errors == 1:
                log.exception("cannot build spans from a record (counted; logged once)")


class _StopSignals:
    """The exporter process's signals. SIGINT (Ctrl-C reaches the whole process group) is ignored:
    the engine stops this process in order, after handing it its last records. SIGTERM is what
    ``systemctl stop`` sends the whole group (issue 44): it used to kill this process with up to
    ``EXPORT_DELAY_MS`` of spans unsent. Now the first SIGTERM sends what is pending at once and
    keeps the process for the engine's last records and its stop; a second one (the engine's
    ``terminate`` when a stop went unanswered) makes it export or spool what it holds and leave."""

    def __init__(self) -> None:
        self.terms = 0  #: SIGTERMs received
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self._wake, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write)  # a signal ends the wait below at once
        signal.signal(signal.SIGTERM, self._term)

    def _term(self, *_: Any) -> None:
        self.terms += 1

    def wait(self, conn: Any, timeout: float | None) -> list[Any]:
        """Wait up to ``timeout`` (None: forever) for a message or a signal; the ready objects."""
        ready = multiprocessing.connection.wait([conn, self._wake], timeout)
        if self._wake in ready:
            os.read(self._wake, 512)
        return ready
