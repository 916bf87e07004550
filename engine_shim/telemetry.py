"""The telemetry thread: finished records in, spans out, and heartbeats on a timer.

The generation loop and the HTTP handlers hand records over with ``submit`` (a lock-free queue
put) and go on; this thread builds the spans (``SpanBuilder``) and passes them to whatever span
processors the tracer provider has. Any exception while building is caught, counted and logged
once: telemetry must never take serving down.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from tokentrace import __version__
from tokentrace.engine_shim.records import (
    Clock,
    HeartbeatRecord,
    LifecycleRecord,
    LoadRecord,
    RequestRecord,
    StepWindow,
)
from tokentrace.engine_shim.spans import SpanBuilder

log = logging.getLogger(__name__)

_STOP = object()
#: Instrumentation scope of every span the shim emits.
SCOPE = "tokentrace.engine_shim"


class Telemetry:
    """Builds spans from records on its own thread.

    ``tracer_provider`` is the SDK provider the caller wired (the CLI's, or an embedding
    application's); None means the global one — this class never sets it.
    """

    def __init__(self, tracer_provider: trace.TracerProvider | None = None, clock: Clock | None = None,
                 heartbeat: Callable[[], HeartbeatRecord | None] | None = None,
                 heartbeat_interval: float = 5.0):
        provider = tracer_provider or trace.get_tracer_provider()
        self.provider = provider
        self.clock = clock or Clock()
        self.builder = SpanBuilder(provider.get_tracer(SCOPE, __version__), self.clock)
        self.heartbeat = heartbeat
        self.heartbeat_interval = heartbeat_interval
        self.built = 0  #: records turned into spans
        self.errors = 0  #: records that failed to build (logged once)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._handlers: dict[type, Callable[[Any], None]] = {
            RequestRecord: self.builder.request,
            StepWindow: self.builder.steps,
            LoadRecord: self.builder.load,
            LifecycleRecord: self.builder.lifecycle,
            HeartbeatRecord: self.builder.heartbeat,
        }

    def start(self) -> Telemetry:
        """Start the thread (idempotent); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tokentrace-telemetry", daemon=True)
            self._thread.start()
        return self

    def submit(self, record: Any) -> None:
        """Hand over a finished record; never blocks, never raises."""
        try:
            self._queue.put(record)
        except Exception:
            self._count_error()

    def close(self, timeout: float = 10.0) -> None:
        """Build everything submitted so far, stop the thread and flush the provider's processors."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout)
            self._thread = None
        else:
            self._drain()
        flush = getattr(self.provider, "force_flush", None)
        if flush is not None:
            try:
                flush(int(timeout * 1000))
            except Exception:
                self._count_error()

    def build(self, record: Any) -> None:
        """Turn one record into spans now, on the calling thread (errors are counted, not raised)."""
        try:
            self._handlers[type(record)](record)
            self.built += 1
        except Exception:
            self._count_error()

    def _run(self) -> None:
        next_beat = time.monotonic() + self.heartbeat_interval
        while True:
            wait = max(0.0, next_beat - time.monotonic()) if self.heartbeat else None
            try:
                record = self._queue.get(timeout=wait)
            except queue.Empty:
                record = None
            if record is _STOP:
                return
            if record is not None:
                self.build(record)
                # Give the GIL back between records so a backlog never holds up the generation
                # thread for a whole switch interval (5 ms: several decode steps of a small model).
                time.sleep(0)
            if self.heartbeat and time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.heartbeat_interval
                self._beat()

    def _beat(self) -> None:
        try:
            record = self.heartbeat()
        except Exception:
            self._count_error()
            return
        if record is not None:
            self.build(record)

    def _drain(self) -> None:
        while True:
            try:
                record = self._queue.get_nowait()
            except queue.Empty:
                return
            if record is not _STOP:
                self.build(record)

    def _count_error(self) -> None:
        self.errors += 1
        if self.errors == 1:
            log.exception("tokentrace telemetry error (counted; further errors are not logged)")
