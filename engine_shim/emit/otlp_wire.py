"""OTLP/HTTP protobuf written straight from the contract's spans: what the MLX engine's exporter
process sends (issue 17, engine overhead).

Why not SDK spans: on the small model at one stream the exporter process spent 55-147 µs of CPU
per generated token, about 3 % of a core that the engine's decode needs on a 2-core machine. Of
that, building SDK spans (the SDK checks every element of every array attribute) and encoding them
(the OTLP encoder makes a protobuf object per array element) were 40-45 µs; written here, the same
spans cost about 3 (docs/benchmarks.md, "Engine overhead").

``WireTracer`` implements the part of OpenTelemetry's tracer API that ``SpanBuilder`` uses: a span
started with explicit times, under a parent given in a context, with attributes, events, a status,
ended with an explicit time. A span becomes wire bytes when it ends, handed to ``on_end``;
``export_request`` wraps a batch in an ``ExportTraceServiceRequest``. Attributes are written by a
C extension (``otlpwire.c``).

What the SDK's spans and its encoder do and these do too: random span and trace ids; flags that
say the parent is not remote; an unset status written as an empty one; events past
``max_events`` drop the oldest and are counted in ``dropped_events_count``; None attribute values left out.
What they do not: sampling (every span is recorded), span processors, links and trace state; the
engine uses none of these. Tests compare the bytes, parsed by protobuf, with what the SDK sends
for the same records.
"""

from __future__ import annotations

import random
import struct
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from tokentrace.engine_shim.emit._otlpwire import attributes as _attributes

#: Field tags (opentelemetry/proto/trace/v1/trace.proto and friends), as the bytes they are written as.
_TRACE_ID, _SPAN_ID, _PARENT_ID, _NAME, _KIND = b"\x0a\x10", b"\x12\x08", b"\x22\x08", b"\x2a", b"\x30"
_START, _END, _EVENT, _DROPPED_EVENTS, _STATUS = b"\x39", b"\x41", b"\x5a", b"\x60", b"\x7a"
_FLAGS_NOT_REMOTE = b"\x85\x01" + struct.pack("<I", 0x100)  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_SPAN_ATTRIBUTES, _EVENT_ATTRIBUTES, _RESOURCE_ATTRIBUTES = 0x4A, 0x1A, 0x0A
_U64 = struct.Struct("<Q")


def varint(value: int) -> bytes:
    """``value`` (0 or more) as a protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the payload's length, the payload."""
    return tag + varint(len(payload)) + payload


class WireSpan(trace.Span):
    """A span being recorded; its wire bytes go to the tracer's ``on_end`` when it ends."""

    def __init__(self, tracer: WireTracer, name: str, kind: SpanKind, start_ns: int, trace_id: int, span_id: int,
                 parent_id: int | None, attributes: dict[str, Any]):
        self._tracer = tracer
        self._name = name
        self._kind = kind
        self._start_ns = start_ns
        self.trace_id = trace_id
        self.span_id = span_id
        self._parent_id = parent_id
        self._attributes = attributes
        self._events: deque[tuple[str, int, Mapping[str, Any] | None]] = deque(maxlen=tracer.max_events)
        self._dropped_events = 0
        self._status: tuple[int, str | None] = (StatusCode.UNSET.value, None)
        self._ended = False

    def get_span_context(self) -> trace.SpanContext:
        return trace.SpanContext(self.trace_id, self.span_id, False, trace.TraceFlags(trace.TraceFlags.SAMPLED))

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self._attributes = {**self._attributes, **attributes}

    def set_attribute(self, key: str, value: Any) -> None:
        self._attributes = {**self._attributes, key: value}

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None) -> None:
        if len(self._events) == self._events.maxlen:
            self._dropped_events += 1  # the oldest goes, as in the SDK
        self._events.append((name, time.time_ns() if timestamp is None else timestamp, attributes))

    def add_link(self, context: trace.SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        raise NotImplementedError("the engine's spans carry no links")

    def update_name(self, name: str) -> None:
        self._name = name

    def is_recording(self) -> bool:
        return not self._ended

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if isinstance(status, Status):
            self._status = (status.status_code.value, status.description)
        else:
            self._status = (status.value, description)

    def record_exception(self, exception: BaseException, attributes: Mapping[str, Any] | None = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        self.add_event("exception", {"exception.type": type(exception).__name__,
                                     "exception.message": str(exception), **(attributes or {})}, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        name = self._name.encode()
        parts = [_TRACE_ID, self.trace_id.to_bytes(16, "big"), _SPAN_ID, self.span_id.to_bytes(8, "big")]
        if self._parent_id is not None:
            parts += (_PARENT_ID, self._parent_id.to_bytes(8, "big"))
        parts += (_NAME, varint(len(name)), name, _KIND, bytes((self._kind.value + 1,)),
                  _START, _U64.pack(self._start_ns), _END, _U64.pack(time.time_ns() if end_time is None else end_time),
                  _attributes(_SPAN_ATTRIBUTES, self._attributes))
        for event_name, at, attributes in self._events:
            encoded = event_name.encode()
            body = b"\x09" + _U64.pack(at) + b"\x12" + varint(len(encoded)) + encoded
            if attributes:
                body += _attributes(_EVENT_ATTRIBUTES, dict(attributes))
            parts += (_EVENT, varint(len(body)), body)
        if self._dropped_events:
            parts += (_DROPPED_EVENTS, varint(self._dropped_events))
        code, message = self._status
        status = (field(b"\x12", message.encode()) if message else b"") + (b"\x18" + bytes((code,)) if code else b"")
        parts += (_STATUS, varint(len(status)), status, _FLAGS_NOT_REMOTE)
        self._tracer.on_end(b"".join(parts))


class WireTracer(trace.Tracer):
    """Starts ``WireSpan``s; each ended span's wire bytes (a ``Span`` message) go to ``on_end``."""

    def __init__(self, on_end: Callable[[bytes], None], max_events: int = 128):
        self.on_end = on_end
        self.max_events = max_events
        self._random = random.Random()

    def start_span(self, name: str, context: Any = None, kind: SpanKind = SpanKind.INTERNAL,
                   attributes: Mapping[str, Any] | None = None, links: Any = None, start_time: int | None = None,
                   record_exception: bool = True, set_status_on_exception: bool = True) -> WireSpan:
        parent = trace.get_current_span(context) if context is not None else None
        if isinstance(parent, WireSpan):
            trace_id, parent_id = parent.trace_id, parent.span_id
        else:
            trace_id, parent_id = self._random.getrandbits(128) or 1, None
        return WireSpan(self, name, kind, time.time_ns() if start_time is None else start_time, trace_id,
                        self._random.getrandbits(64) or 1, parent_id,
                        attributes if type(attributes) is dict else dict(attributes or {}))

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the engine's spans are built with explicit parents, never as current spans")


def resource_attributes(attributes: Mapping[str, Any]) -> bytes:
    """A ``Resource`` message with ``attributes``."""
    return _attributes(_RESOURCE_ATTRIBUTES, dict(attributes))


def scope(name: str, version: str | None) -> bytes:
    """An ``InstrumentationScope`` message."""
    return field(b"\x0a", name.encode()) + (field(b"\x12", version.encode()) if version else b"")


def export_request(resource: bytes, scope_message: bytes, spans: list[bytes]) -> bytes:
    """An ``ExportTraceServiceRequest`` of one resource and one scope holding ``spans`` (each a
    ``Span`` message as ``WireTracer`` hands it over)."""
    scope_spans = b"".join([field(b"\x0a", scope_message), *(field(b"\x12", span) for span in spans)])
    return field(b"\x0a", field(b"\x0a", resource) + field(b"\x12", scope_spans))
