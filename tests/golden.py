"""Replays golden traces (tests/fixtures/*.json, our own span-list format) through the real
OpenTelemetry SDK and its OTLP proto-HTTP exporter, with explicit ids of parents and timestamps."""

from __future__ import annotations

import json
from pathlib import Path

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

FIXTURES = Path(__file__).parent / "fixtures"


def load(name: str) -> dict:
    """A fixture by file name."""
    return json.loads((FIXTURES / name).read_text(encoding="utf-8"))


def replay(fixture: dict, endpoint: str, base_ns: int, headers: dict | None = None) -> dict[str, tuple[str, str]]:
    """Send every span of the fixture; returns {fixture span id: (trace id hex, span id hex)}."""
    provider = TracerProvider(resource=Resource.create(fixture["resource"]))
    exporter = OTLPSpanExporter(endpoint=endpoint, headers=headers or {})
    provider.add_span_processor(BatchSpanProcessor(exporter))
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
    assert provider.force_flush(30_000), "the exporter did not flush"
    provider.shutdown()
    return ids
