"""Ship spans from inside a vLLM process to the collector over OTLP/HTTP, off vLLM's hot path.

vLLM calls the stat logger on its output-handler loop, so the plugin only appends numbers there;
this module's one daemon thread turns them into spans every ``interval`` seconds (DESIGN §3,
overhead rule) and posts them with the OpenTelemetry OTLP/HTTP exporter. Spans are built as
``ReadableSpan`` with explicit ids and timestamps rather than through a ``TracerProvider``: the
plugin must choose the ``model.load`` span id before vLLM starts (vLLM's own loading spans are
parented to it through ``TRACEPARENT``), and no global provider may be installed inside vLLM, which
owns the global one when ``--otlp-traces-endpoint`` is set.

With a spool directory, batches the collector does not take are written there (the engine shim's
spool, engine_shim/emit/spool.py) and resent when it answers again, or ingested by a collector watching
that directory. Export failures are logged (the first, then every 100th) and counted, never raised
into vLLM.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokentrace.threads import os_named

log = logging.getLogger("vllm.tokentrace")

#: An attribute value the OTLP exporter accepts.
AttrValue = str | bool | int | float | Sequence[str] | Sequence[int] | Sequence[float]


def new_trace_id() -> int:
    """A random, valid 128-bit trace id."""
    return secrets.randbits(128) or 1


def new_span_id() -> int:
    """A random, valid 64-bit span id."""
    return secrets.randbits(64) or 1


@dataclass
class SpanEvent:
    """An event on a span: a name, a wall-clock time and attributes."""

    name: str
    time_ns: int
    attributes: dict[str, AttrValue] = field(default_factory=dict)


@dataclass
class SpanRecord:
    """A finished span, described by plain values; ``to_readable`` makes the SDK object."""

    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, AttrValue] = field(default_factory=dict)
    events: list[SpanEvent] = field(default_factory=list)
    #: 0 means "new": a root span in a new trace, or a new span id
    trace_id: int = 0
    span_id: int = 0
    parent_span_id: int = 0
    server: bool = False  #: SpanKind.SERVER (request roots) instead of INTERNAL

    def to_readable(self, resource: Any) -> Any:
        """The ``opentelemetry.sdk.trace.ReadableSpan`` the OTLP exporter encodes."""
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

        trace_id = self.trace_id or new_trace_id()
        flags = TraceFlags(TraceFlags.SAMPLED)
        context = SpanContext(trace_id, self.span_id or new_span_id(), False, flags)
        parent = SpanContext(trace_id, self.parent_span_id, True, flags) if self.parent_span_id else None
        return ReadableSpan(
            name=self.name,
            context=context,
            parent=parent,
            resource=resource,
            attributes=self.attributes,
            events=[Event(e.name, e.attributes, e.time_ns) for e in self.events],
            kind=SpanKind.SERVER if self.server else SpanKind.INTERNAL,
            instrumentation_scope=InstrumentationScope("tokentrace.engine_shim.vllm"),
            start_time=self.start_ns,
            end_time=max(self.end_ns, self.start_ns),
        )


#: A producer the pump polls: given the wall clock (ns) and whether this is the last poll before
#: shutdown (flush everything), returns the spans that are ready.
Source = Callable[[int, bool], list[SpanRecord]]


class SpanPump:
    """One daemon thread that polls sources and exports what they return; thread-safe ``submit``."""

    def __init__(
        self,
        collector: str,
        resource: Mapping[str, AttrValue],
        interval: float = 0.5,
        max_pending: int = 20_000,
        timeout: float = 5.0,
        spool_dir: str | None = None,
        spool_max_bytes: int = 256 << 20,
    ) -> None:
        self.collector = collector  #: the collector's base URL
        self.interval = interval
        self.timeout = timeout
        self.spool_dir = spool_dir
        self.spool_max_bytes = spool_max_bytes
        self.sent = 0  #: spans the collector acknowledged, or that wait in the spool for it
        self.failed = 0  #: spans in batches that failed to export (and could not be spooled)
        self.dropped = 0  #: spans dropped because the pending queue was full
        self._failures = 0
        self._resource_attrs = dict(resource)
        self._pending: deque[SpanRecord] = deque()
        self._max_pending = max_pending
        self._sources: list[Source] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._exporter: Any = None
        self._resource: Any = None
        self._thread = threading.Thread(target=os_named(self._run), name="tokentrace-vllm-export", daemon=True)

    def start(self) -> None:
        """Start the export thread (idempotent)."""
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def add_source(self, source: Source) -> None:
        """Poll ``source`` on every tick of the export thread."""
        with self._lock:
            self._sources.append(source)

    def submit(self, record: SpanRecord) -> None:
        """Queue one finished span; drops (and counts) it when the queue is full."""
        with self._lock:
            if len(self._pending) >= self._max_pending:
                self.dropped += 1
                return
            self._pending.append(record)

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is pending and stop the thread: its last export gets ``timeout`` plus the
        export's own timeout, after which a collector that did not answer has had the batch spooled
        (a join shorter than the export's timeout left a stuck collector's last batch half-sent at
        interpreter exit; issue 44)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout + self.timeout)
        if self._exporter is not None:
            self._exporter.shutdown()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._tick(final=False)
        self._tick(final=True)

    def _tick(self, final: bool) -> None:
        now = time.time_ns()
        with self._lock:
            sources = list(self._sources)
        records: list[SpanRecord] = []
        for source in sources:
            try:
                records.extend(source(now, final))
            except Exception:  # a bug in a source must not stop the other sources or vLLM
                log.exception("tokentrace: building spans failed")
        with self._lock:
            records.extend(self._pending)
            self._pending.clear()
        if records:
            self._export(records)

    def _new_exporter(self) -> Any:
        from tokentrace.engine_shim.emit.spool import Spool, SpoolingSpanExporter

        name = f"vllm-{self._resource_attrs.get('service.instance.id', '')}"
        spool = Spool(self.spool_dir, self.spool_max_bytes, name) if self.spool_dir else None
        return SpoolingSpanExporter(self.collector, spool, timeout=self.timeout)

    def _export(self, records: list[SpanRecord]) -> None:
        spooled_before = spooled_after = 0
        try:
            if self._exporter is None:
                from opentelemetry.sdk.resources import Resource

                self._exporter = self._new_exporter()
                self._resource = Resource(self._resource_attrs)
            spooled_before = self._exporter.spooled_batches
            result = self._exporter.export([r.to_readable(self._resource) for r in records])
            ok = result.name == "SUCCESS"
            spooled_after = self._exporter.spooled_batches
        except Exception as exc:  # swallowing is right only here: export must never hurt serving
            ok = False
            log.debug("tokentrace: export raised %r", exc)
        spooled = spooled_after > spooled_before
        if ok:
            self.sent += len(records)
        else:
            self.failed += len(records)
        if ok and not spooled:
            return
        self._failures += 1
        if self._failures % 100 == 1:
            kept = f"spooled to {self.spool_dir}, sent when it answers" if spooled else "lost"
            log.warning(
                "tokentrace: could not export %d spans to %s (%d export failures so far; %s); "
                "vLLM keeps serving", len(records), f"{self.collector}/v1/traces", self._failures, kept,
            )
