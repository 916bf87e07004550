"""The telemetry thread: finished records in, handed to a sink, and heartbeats on a timer.

The generation loop and the HTTP handlers hand records over with ``submit`` (a lock-free queue
put) and go on. This thread passes each record to a *sink*: ``ExporterProcess`` in the engine
(the records are pickled to a separate process that builds and exports the spans, so span
building never competes with generation for the GIL), or ``SpanSink`` for embedders (spans built
right here, on the caller's tracer provider). Any exception is caught, counted and logged once:
telemetry must never take serving down.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from opentelemetry import trace

from tokentrace import __version__
from tokentrace.engine_shim.mlx.records import Clock, HeartbeatRecord
from tokentrace.engine_shim.mlx.spans import SpanBuilder
from tokentrace.threads import os_named

log = logging.getLogger(__name__)

_STOP = object()
#: Instrumentation scope of every span the shim emits.
SCOPE = "tokentrace.engine_shim"
#: Records allowed to wait for the sink; beyond that they are dropped and counted, so that a sink
#: that cannot keep up never grows the engine's memory without bound.
MAX_PENDING = 20_000
#: While a prefill is running (``Telemetry.prefilling``), a record waits at most this long after its
#: hand-over before the thread handles it anyway, so that under constant arrivals telemetry still
#: keeps up and nothing waits unbounded.
PREFILL_HOLD_S = 0.25


class RecordSink(Protocol):
    """Where finished records go."""

    def handle(self, record: Any) -> None:
        """Take one record (called on the telemetry thread only)."""

    def flush(self, timeout: float) -> bool:
        """Make everything handled so far leave the process; False on timeout."""

    def close(self, timeout: float) -> None:
        """Flush and release resources."""


class SpanSink:
    """Builds spans on the telemetry thread, on a tracer provider the caller wired (or the global
    one); this class never installs a provider."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None, clock: Clock | None = None):
        self.provider = tracer_provider or trace.get_tracer_provider()
        self.builder = SpanBuilder(self.provider.get_tracer(SCOPE, __version__), clock or Clock())

    def handle(self, record: Any) -> None:
        """Build the record's spans now."""
        self.builder.build(record)

    def flush(self, timeout: float) -> bool:
        """Flush the provider's span processors."""
        flush = getattr(self.provider, "force_flush", None)
        return bool(flush(int(timeout * 1000))) if flush is not None else True

    def close(self, timeout: float) -> None:
        """Flush (the provider belongs to the caller, who shuts it down)."""
        self.flush(timeout)


class Telemetry:
    """Moves records from the serving threads to a sink on its own thread."""

    def __init__(self, sink: RecordSink, heartbeat: Callable[[], HeartbeatRecord | None] | None = None,
                 heartbeat_interval: float = 5.0):
        self.sink = sink
        self.heartbeat = heartbeat
        self.heartbeat_interval = heartbeat_interval
        self.handled = 0  #: records the sink took
        self.errors = 0  #: records lost to an exception (logged once)
        self.dropped = 0  #: records dropped because MAX_PENDING were already waiting
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._quiet = threading.Event()  #: set while no prefill is running
        self._quiet.set()

    def start(self) -> Telemetry:
        """Start the thread (idempotent); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=os_named(self._run), name="tokentrace-telemetry", daemon=True)
            self._thread.start()
            # A normal exit without close() still hands over and flushes every record (issue 44).
            # Registered after multiprocessing's own exit hook, so it runs first: that hook
            # terminates and joins the exporter process, which waits for its stop (exporter_process.py).
            atexit.register(self.close)
        return self

    def submit(self, record: Any) -> None:
        """Hand over a finished record; never blocks, never raises."""
        try:
            if self._queue.qsize() >= MAX_PENDING:
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("telemetry cannot keep up: records are being dropped (counted)")
                return
            self._queue.put((time.monotonic(), record))
        except Exception:
            self._count_error()

    def prefilling(self, active: bool) -> None:
        """The generation thread says a prefill started (True) or that no admitted sequence still
        waits for its first token (False). Meanwhile records wait (up to ``PREFILL_HOLD_S`` after
        their hand-over): pickling one to the exporter holds the GIL the generation thread needs,
        and the exporter's span building takes CPU, both of which would otherwise land in the next
        request's time to first token (the closed loop hands a record over just as the next request
        arrives)."""
        if active:
            self._quiet.clear()
        else:
            self._quiet.set()

    def flush(self, timeout: float = 10.0) -> bool:
        """Hand everything submitted so far to the sink and flush it; False on timeout."""
        if self._thread is None:
            self._drain()
            return self._flush_sink(timeout)
        done = threading.Event()
        result: list[bool] = []
        self._queue.put((done, timeout, result))
        return done.wait(timeout + 1) and bool(result and result[0])

    def close(self, timeout: float = 10.0) -> None:
        """Hand over everything submitted, stop the thread, close the sink."""
        atexit.unregister(self.close)
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout)
            self._thread = None
        self._drain()
        try:
            self.sink.close(timeout)
        except Exception:
            self._count_error()

    def _run(self) -> None:
        next_beat = time.monotonic() + self.heartbeat_interval
        while True:
            wait = max(0.0, next_beat - time.monotonic()) if self.heartbeat else None
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            if item is not None:
                if type(item) is tuple and len(item) == 2 and not self._quiet.is_set():
                    self._quiet.wait(max(0.0, item[0] + PREFILL_HOLD_S - time.monotonic()))
                self._handle(item)
                # Give the GIL back between records, so that a backlog never holds up the
                # generation thread for a whole switch interval (5 ms: several decode steps).
                time.sleep(0)
            if self.heartbeat and time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.heartbeat_interval
                self._beat()

    def _handle(self, item: Any) -> None:
        if type(item) is tuple and len(item) == 3 and isinstance(item[0], threading.Event):
            done, timeout, result = item  # a flush marker: everything before it was handled
            result.append(self._flush_sink(timeout))
            done.set()
            return
        if type(item) is tuple and len(item) == 2:
            item = item[1]  # (hand-over time, record)
        try:
            self.sink.handle(item)
            self.handled += 1
        except Exception:
            self._count_error()

    def _flush_sink(self, timeout: float) -> bool:
        try:
            return self.sink.flush(timeout)
        except Exception:
            self._count_error()
            return False

    def _beat(self) -> None:
        try:
            record = self.heartbeat()
        except Exception:
            self._count_error()
            return
        if record is not None:
            self._handle(record)

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                self._handle(item)

    def _count_error(self) -> None:
        self.errors += 1
        if self.errors == 1:
            log.exception("tokentrace telemetry error (counted; further errors are not logged)")
