"""Replays golden traces (tests/fixtures/*.json, our own span-list format) through the real
OpenTelemetry SDK, with explicit ids of parents and timestamps: over HTTP with its OTLP proto-HTTP
exporter (``replay``), or as the protobuf body that exporter would send (``encode``)."""

from __future__ import annotations

import json
from pathlib import Path

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

FIXTURES = Path(__file__).parent / "fixtures"


def load(name: str) -> dict:
    """A fixture by file name."""
    return json.loads((FIXTURES / name).read_text(encoding="utf-8"))


def _emit(fixture: dict, processor, base_ns: int) -> dict[str, tuple[str, str]]:
    """Start and end every span of the fixture on a provider feeding ``processor``; returns
    {fixture span id: (trace id hex, span id hex)}."""
    provider = TracerProvider(resource=Resource.create(fixture["resource"]))
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("tokentrace.tests.golden")
    live, ids = {}, {}
    for spec in fixture["spans"]:
        parent = live.get(spec.get("parent"))
        context = trace.set_span_in_context(parent) if parent is not None else None
        span = tracer.start_span(
            spec["name"], context=context, kind=getattr(trace.SpanKind, spec.get("kind", "INTERNAL")),
            attributes=spec.get("attributes", {}), start_time=base_ns + spec["start"],
        )
        for event in spec.get("events", []):
            span.add_event(event["name"], event.get("attributes", {}), timestamp=base_ns + event["t"])
        live[spec["id"]] = span
        ctx = span.get_span_context()
        ids[spec["id"]] = (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
    for spec in fixture["spans"]:
        live[spec["id"]].end(end_time=base_ns + spec["end"])
    assert provider.force_flush(30_000), "the span processor did not flush"
    provider.shutdown()
    return ids


def replay(fixture: dict, endpoint: str, base_ns: int, headers: dict | None = None) -> dict[str, tuple[str, str]]:
    """Send every span of the fixture; returns {fixture span id: (trace id hex, span id hex)}."""
    exporter = OTLPSpanExporter(endpoint=endpoint, headers=headers or {})
    return _emit(fixture, BatchSpanProcessor(exporter), base_ns)


def encode(fixture: dict, base_ns: int) -> tuple[bytes, dict[str, tuple[str, str]]]:
    """The OTLP protobuf body the SDK's exporter would send for the fixture, and its ids."""
    exporter = InMemorySpanExporter()
    ids = _emit(fixture, SimpleSpanProcessor(exporter), base_ns)
    return encode_spans(exporter.get_finished_spans()).SerializeToString(), ids
