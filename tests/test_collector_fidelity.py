"""Issue 11 item 6: what OTLP sends is stored as sent. Links with their attributes and trace state,
the span's trace state, the scope version and the dropped counts, from the real OpenTelemetry SDK;
mixed arrays and NaN/Infinity from hand-written OTLP JSON; names and status messages cut to the
attribute length limit; and links with attributes and trace states from the real OpenTelemetry JS
SDK under Node.js (tests/node), as the trial's Node.js sender sent them; and a large export of the
SDK, whose spans the collector keeps in a Parquet span file (issue 17)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.trace import Link, SpanContext, TraceFlags, TraceState
from opentelemetry.trace.status import Status, StatusCode

LIMIT = 4096


def test_the_sdk_s_links_trace_state_scope_version_and_dropped_counts_are_kept(collector_factory):
    collector = collector_factory("--max-attribute-length", str(LIMIT)).start()
    provider = TracerProvider(resource=Resource.create({"service.name": "fidelity"}),
                              span_limits=SpanLimits(max_span_attributes=2, max_events=1, max_links=2))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=collector.url + "/v1/traces")))
    tracer = provider.get_tracer("fidelity.scope", "3.1.4")
    linked = [SpanContext(int.from_bytes(os.urandom(16)), int.from_bytes(os.urandom(8)), is_remote=True,
                          trace_flags=TraceFlags(1), trace_state=TraceState([("vendor", f"v{i}")])) for i in range(3)]
    parent = SpanContext(int.from_bytes(os.urandom(16)), int.from_bytes(os.urandom(8)), is_remote=True,
                         trace_flags=TraceFlags(1), trace_state=TraceState([("congo", "t61rcWkgMzE")]))
    links = [Link(linked[0], {"link.kind": "follows"}), Link(linked[1], {"n": 2}), Link(linked[2])]
    span = tracer.start_span("n" * 10_000, context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
                             links=links,  # over the limit of 2, the SDK drops the oldest attributes
                             attributes={"dropped.1": "x", "dropped.2": "y", "a": 1, "nan": math.nan})
    for name in ("e1", "e2", "e3"):
        span.add_event(name)
    span.set_status(Status(StatusCode.ERROR, "m" * 10_000))
    span.end()
    provider.shutdown()
    assert collector.stop() == 0

    [(name, status, attributes, events, stored_links, trace_state, scope_version, dropped)] = collector.sql(
        "SELECT name, status_message, attributes, events, links, trace_state, scope_version, "
        "[dropped_attributes_count, dropped_events_count, dropped_links_count] FROM spans")
    assert (name, status) == ("n" * LIMIT, "m" * LIMIT)
    assert json.loads(attributes) == {"a": 1, "nan": "NaN"}  # NaN as OTLP JSON writes it: valid JSON
    assert [event["name"] for event in json.loads(events)] == ["e3"]
    assert (trace_state, scope_version, dropped) == ("congo=t61rcWkgMzE", "3.1.4", [2, 2, 1])
    # The SDK keeps the newest links under its limit; its encoder sends no link trace state (the
    # hand-written case below does).
    assert json.loads(stored_links) == [
        {"trace_id": f"{linked[1].trace_id:032x}", "span_id": f"{linked[1].span_id:016x}", "attributes": {"n": 2}},
        {"trace_id": f"{linked[2].trace_id:032x}", "span_id": f"{linked[2].span_id:016x}"},
    ]


def test_a_large_export_of_the_sdk_is_stored_in_a_span_file_as_sent(collector_factory):
    """10,000 spans in one export of the real SDK (BatchSpanProcessor): a merge of that many writes its
    spans to a Parquet file (collector/stores/span_files.py), and what is read back through `spans` is
    what the SDK sent: every span once, attributes, events, links with attributes, trace state."""
    collector = collector_factory().start()
    provider = TracerProvider(resource=Resource.create({"service.name": "bulk"}))
    provider.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=collector.url + "/v1/traces"), max_queue_size=10_000,
        max_export_batch_size=10_000, schedule_delay_millis=600_000))  # one export, at shutdown
    tracer = provider.get_tracer("bulk.scope", "2.0")
    parent = SpanContext(int.from_bytes(os.urandom(16)), int.from_bytes(os.urandom(8)), is_remote=True,
                         trace_flags=TraceFlags(1), trace_state=TraceState([("congo", "t61rcWkgMzE")]))
    linked = SpanContext(int.from_bytes(os.urandom(16)), int.from_bytes(os.urandom(8)), is_remote=True)
    sent = []
    for i in range(10_000):
        span = tracer.start_span(f"op-{i % 7}", context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
                                 links=[Link(linked, {"n": i})], attributes={"i": i, "s": "x" * (i % 40),
                                                                               "f": i / 4, "b": i % 2 == 0})
        span.add_event("ev", {"k": i})
        span.end()
        sent.append(span)
    provider.shutdown()
    assert collector.stop() == 0
    [(files, in_files)] = collector.sql("SELECT count(*), sum(spans) FROM span_files")
    assert files >= 1 and in_files == 10_000
    [(rows, distinct, in_rows)] = collector.sql(
        "SELECT count(*), count(DISTINCT span_id), (SELECT count(*) FROM span_rows) FROM spans")
    assert (rows, distinct, in_rows) == (10_000, 10_000, 0)  # every span once, all from the file
    stored = {span_id: row for span_id, *row in collector.sql(
        "SELECT span_id, name, attributes, events, links, trace_state, scope_version FROM spans")}
    for span in sent[::997]:
        name, attributes, events, links, trace_state, scope_version = stored[f"{span.context.span_id:016x}"]
        i = span.attributes["i"]
        assert name == f"op-{i % 7}"
        assert json.loads(attributes) == {"i": i, "s": "x" * (i % 40), "f": i / 4, "b": i % 2 == 0}
        assert [(e["name"], e["attributes"]) for e in json.loads(events)] == [("ev", {"k": i})]
        assert json.loads(links) == [{"trace_id": f"{linked.trace_id:032x}", "span_id": f"{linked.span_id:016x}",
                                      "attributes": {"n": i}}]
        assert (trace_state, scope_version) == ("congo=t61rcWkgMzE", "2.0")


def test_hand_written_json_keeps_mixed_arrays_non_finite_doubles_and_dropped_counts(collector_factory):
    collector = collector_factory().start()
    span = {
        "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174", "name": "mixed",
        "startTimeUnixNano": "1544712660000000000", "endTimeUnixNano": "1544712661000000000",
        "traceState": "rojo=00f067aa0ba902b7", "droppedAttributesCount": 3, "droppedEventsCount": 4,
        "droppedLinksCount": 5,
        "attributes": [
            {"key": "mixed", "value": {"arrayValue": {"values": [{"intValue": "1"}, {"stringValue": "s"},
                                                                 {"doubleValue": 2.5}]}}},
            {"key": "zeros", "value": {"arrayValue": {"values": [{"intValue": "0"}, {"doubleValue": 0.0},
                                                                 {"boolValue": False}]}}},
            {"key": "ints", "value": {"arrayValue": {"values": [{"intValue": "0"}, {"intValue": "7"}]}}},
            {"key": "nan", "value": {"doubleValue": "NaN"}},
            {"key": "inf", "value": {"doubleValue": "Infinity"}},
            {"key": "ninf", "value": {"arrayValue": {"values": [{"doubleValue": "-Infinity"}, {"doubleValue": 1}]}}},
        ],
        "events": [{"name": "ev", "timeUnixNano": "1544712660500000000", "droppedAttributesCount": 1}],
        "links": [{"traceId": "0af7651916cd43dd8448eb211c80319c", "spanId": "b7ad6b7169203331",
                   "traceState": "k=v", "droppedAttributesCount": 6,
                   "attributes": [{"key": "why", "value": {"stringValue": "retry-of"}}]}],
    }
    body = {"resourceSpans": [{"scopeSpans": [{"scope": {"name": "hand", "version": "0.9"}, "spans": [span]}]}]}
    response = collector.post(json.dumps(body).encode(), "application/json")
    assert response.status_code == 200, response.text
    assert collector.stop() == 0
    [(attributes, events, links, trace_state, scope_version, dropped)] = collector.sql(
        "SELECT attributes, events, links, trace_state, scope_version, "
        "[dropped_attributes_count, dropped_events_count, dropped_links_count] FROM spans")
    assert json.loads(attributes) == {"mixed": [1, "s", 2.5], "zeros": [0, 0.0, False], "ints": [0, 7],
                                      "nan": "NaN", "inf": "Infinity", "ninf": ["-Infinity", 1.0]}
    assert '"mixed":[1,"s",2.5]' in attributes and '"zeros":[0,0.0,false]' in attributes  # types as sent
    assert json.loads(events)[0]["dropped_attributes_count"] == 1
    assert json.loads(links) == [{"trace_id": "0af7651916cd43dd8448eb211c80319c", "span_id": "b7ad6b7169203331",
                                  "trace_state": "k=v", "attributes": {"why": "retry-of"},
                                  "dropped_attributes_count": 6}]
    assert (trace_state, scope_version, dropped) == ("rojo=00f067aa0ba902b7", "0.9", [3, 4, 5])


NODE_DIR = Path(__file__).parent / "node"


def _node_sdk() -> Path:
    """tests/node with its OpenTelemetry JS packages installed (npm, once; package-lock.json pins
    them); skips when Node.js or the npm registry is not available here."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("Node.js is not installed")
    if not (NODE_DIR / "node_modules" / "@opentelemetry" / "sdk-trace-base").is_dir():
        result = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True,
                                text=True, timeout=300)
        if result.returncode != 0:
            pytest.skip(f"npm could not install the OpenTelemetry JS SDK: {result.stderr[-300:]}")
    return NODE_DIR


def test_the_node_sdk_s_links_and_trace_states_are_kept(collector_factory):
    """The trial's Node.js sender lost every link attribute; the real JS SDK sends them here."""
    node_dir = _node_sdk()
    collector = collector_factory().start()
    result = subprocess.run(["node", "otlp_sender.mjs", collector.url + "/v1/traces", "4"], cwd=node_dir,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    linked = json.loads(result.stdout)
    assert collector.stop() == 0
    rows = collector.sql("SELECT name, attributes, links, trace_state, scope_version FROM spans ORDER BY name")
    assert [row[0] for row in rows] == [f"node-span-{i}" for i in range(4)]
    for i, (_, attributes, links, trace_state, scope_version) in enumerate(rows):
        assert json.loads(attributes) == {"node.index": i, "node.nan": "NaN"}
        assert (trace_state, scope_version) == ("congo=t61rcWkgMzE", "2.7.1")
        assert json.loads(links) == [{"trace_id": linked[i]["traceId"], "span_id": linked[i]["spanId"],
                                      "trace_state": f"vendor=v{i}",
                                      "attributes": {"link.kind": "follows", "link.index": i}}]
