"""The differential harness of the compiled decoder's tests (test_fastpath*.py): the Python path's
Columns as the reference, an exact comparison, and the payloads: the SDK's encoding of our shims'
spans (the MLX engine's span builder, the gateway's observer), OTLP JSON fixtures, and a generator
of engine-shaped batches with odd but legal values."""

from __future__ import annotations

import asyncio
import json
import random
import time

import golden
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_collector_validation import set_any

from tokentrace import contract as c
from tokentrace.collector.decoding import fastpath
from tokentrace.collector.decoding.columns import SCHEMAS, Columns
from tokentrace.collector.decoding.normalize import normalize
from tokentrace.collector.receiver.otlp import JSON, PROTOBUF, Encoding, decode
from tokentrace.engine_shim.emit import otlp_wire
from tokentrace.engine_shim.emit.otlp_wire import varint

MAX = 65_536
PB = Encoding("protobuf", PROTOBUF)


# --- the differential harness ------------------------------------------------------------------------
def reference(body: bytes, max_len: int = MAX) -> Columns:
    """What the Python path makes of a protobuf body (DecodeError when it refuses it: a 400)."""
    return normalize(ExportTraceServiceRequest.FromString(body), max_len).columns()


def assert_same(got: Columns, expected: Columns) -> None:
    """Every table, origin array, key hash and counter equal."""
    assert list(got.tables) == list(expected.tables)
    for name, table in expected.tables.items():
        mine = got.tables[name]
        mine.validate(full=True)
        assert mine.schema.equals(SCHEMAS[name]), name
        if not mine.equals(table):  # Arrow's equals, like ==, never finds a NaN equal to a NaN
            for column in table.column_names:
                a, b = mine.column(column).to_pylist(), table.column(column).to_pylist()
                row = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if repr(x) != repr(y)), None)
                assert row is None, f"{name}.{column} row {row}: {a[row]!r} != {b[row]!r}"
        assert got.origin[name].dtype == np.int32 and np.array_equal(got.origin[name], expected.origin[name]), name
    assert got.keys.dtype == np.uint64 and np.array_equal(got.keys, expected.keys)
    assert (got.spans, got.rejected, got.truncated, got.duplicates, got.problems, got.rejected_by, got.left_out) == (
        expected.spans, expected.rejected, expected.truncated, expected.duplicates, expected.problems,
        expected.rejected_by, expected.left_out)


def check(body: bytes, max_len: int = MAX) -> Columns | None:
    """The decoder's answer, after checking it: None, or exactly the Python path's Columns."""
    got = fastpath.decode(body, max_len)
    if got is None:
        return None
    try:
        expected = reference(body, max_len)
    except DecodeError as exc:
        pytest.fail(f"decoded a body the Python path refuses: {exc}")
    assert_same(got, expected)
    return got


def taken(body: bytes, max_len: int = MAX) -> Columns:
    """``check``, and the C path must have been taken."""
    got = check(body, max_len)
    assert got is not None, "the decoder left an ordinary payload to Python"
    return got


# --- payloads: the SDK, our shims --------------------------------------------------------------------
def sdk_spans(resource: dict, build) -> bytes:
    """The protobuf body the SDK's OTLP exporter sends for the spans ``build(tracer)`` makes."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(resource))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    build(provider.get_tracer("tokentrace.tests.fastpath", "1.0"))
    provider.shutdown()
    return encode_spans(exporter.get_finished_spans()).SerializeToString()


def mlx_payload(seed: int, wire: bool = False) -> bytes:
    """Every record kind of the MLX engine, built into spans by its own SpanBuilder: on the SDK, or
    (``wire``) written as its exporter process writes them (engine_shim/emit/otlp_wire.py)."""
    from tokentrace.engine_shim.mlx.prompts import Prompt
    from tokentrace.engine_shim.mlx.records import (
        Clock,
        EvictionRecord,
        HeartbeatRecord,
        InsertRecord,
        LifecycleRecord,
        LoadRecord,
        LookupRecord,
        RequestRecord,
        StepWindow,
    )
    from tokentrace.engine_shim.mlx.spans import SpanBuilder

    rng, t0 = random.Random(seed), 1_000_000_000

    def build(tracer) -> None:
        builder = SpanBuilder(tracer, Clock(offset_ns=1_700_000_000_000_000_000))
        builder.build(LoadRecord("load-1", "/models/tiny", rng.random() < 0.5, t0, t0 + 9_000, stages=[
            (c.SPAN_LOAD_RESOLVE, t0, t0 + 1_000, {}), (c.SPAN_LOAD_WEIGHTS, t0 + 1_000, t0 + 6_000,
                                                         {c.LOAD_BYTES: 123_456}),
            (c.SPAN_LOAD_WARMUP, t0 + 6_000, t0 + 9_000, {})]))
        builder.build(LifecycleRecord(c.EVENT_STARTED, t0))
        for n in range(6):
            tokens = [rng.randrange(1, 30_000) for _ in range(rng.randrange(20, 90))]
            at = t0 + 10_000 + n * 1_000_000
            record = RequestRecord(f"mlx-{seed}-{n}", "/v1/chat/completions", at, session_id="s1", model="tiny",
                                   max_tokens=64, streamed=n % 2 == 0, first_response=n == 0)
            record.prompt = Prompt(tokens, ["system", "user"], [0, 10], [10, len(tokens)],
                                   snippets=["be brief", "hi \"there\"\n☃"] if n % 3 == 0 else None)
            record.enqueue_ns, record.admit_ns, record.queue_depth, record.max_batch = at + 5, at + 100, n, 8
            record.lookup = LookupRecord(10 * (n % 2), c.MATCH_PREFIX if n % 2 else c.MATCH_NONE, n, n * 4096,
                                         entry_tokens=tokens[:10] if n % 2 else None)
            record.lookup_end_ns = at + 150
            record.chunk_start_ns, record.chunk_end_ns = [at + 150, at + 400], [at + 400, at + 700]
            record.chunk_offset, record.chunk_tokens, record.chunk_batch = [0, 40], [40, len(tokens) - 40], [1, 2]
            record.token_ns = [at + 1_000 + i * rng.randrange(50, 90) for i in range(rng.randrange(1, 30))]
            record.finish_ns, record.finish_reason = record.token_ns[-1], "stop"
            evictions = [EvictionRecord(tokens[:5], 4096, f"mlx-{seed}-old", "max_entries", 3, 9_000)] * (n % 3)
            record.insertion = InsertRecord(tokens, 8192, 4, 10_000, 16, 1 << 30, evictions, [None, 0, 1][n % 3])
            record.insert_start_ns, record.insert_end_ns = record.finish_ns, record.finish_ns + 50
            record.first_content_ns, record.end_ns = at + 1_200, record.finish_ns + 100
            builder.build(record)
        window = StepWindow([t0 + i * 100 for i in range(8)], [90] * 8, [1, 0] * 4, [0, 1] * 4, [40, 0] * 4,
                            [0, 1] * 4, [f"mlx-{seed}-{i // 2}" for i in range(8)])
        builder.build(window)
        builder.build(HeartbeatRecord(t0 + 5_000_000, 1, 2, 8, 3, 300_000, 16, 1 << 30, 1000, 10**9))

    resource = {c.SERVICE_NAME: "tokentrace-engine", c.SERVICE_INSTANCE_ID: f"mlx-{seed}", c.ENGINE: c.ENGINE_MLX,
                c.ENGINE_VERSION: "0.32.0", c.MODEL: "tiny"}
    if not wire:
        return sdk_spans(resource, build)
    spans: list[bytes] = []
    build(otlp_wire.WireTracer(spans.append))
    return otlp_wire.export_request(otlp_wire.resource_attributes(Resource.create(resource).attributes),
                                    otlp_wire.scope("tokentrace.tests.fastpath", "1.0"), spans)


def gateway_payloads() -> list[bytes]:
    """The gateway observer's spans for one routed, streamed exchange and a lifecycle event."""
    from tokentrace.engine_shim.gateway.adapters.base import CHAT, Adapter, Probe
    from tokentrace.engine_shim.gateway.observe import Observer
    from tokentrace.engine_shim.gateway.records import Exchange
    from tokentrace.engine_shim.gateway.router import Decision
    from tokentrace.engine_shim.gateway.upstreams import Upstream

    exporter = InMemorySpanExporter()
    observer = Observer(lambda name: exporter, block_size=16, schedule_delay_ms=10)
    upstream = Upstream("gw-up", "http://gw-up", 4)
    upstream.adapter = Adapter(upstream.name, upstream.base_url, None, Probe("openai"))
    t = time.perf_counter_ns()
    chunks = [(t + 5_000 + i * 1_000, b"data: " + json.dumps({"choices": [{"delta": {"content": f"w{i}"}}]}).encode()
               + b"\n\n") for i in range(5)]
    exchange = Exchange(
        "gw-1", "sess-1", CHAT, {"model": "m", "messages": [{"role": "user", "content": "hello there " * 20}],
                                 "stream": True}, True, t,
        decision=Decision(upstream, ("gw-up", "other"), (1.0, 0.5), "least loaded"), policy="least_loaded",
        attempts=2, skipped=["other:down"], wait_ns=1_000, admitted_ns=t + 1_000, sent_ns=t + 2_000, status=200,
        chunks=[*chunks, (t + 20_000, b"data: [DONE]\n\n")], end_ns=t + 30_000)

    async def run() -> None:
        observer.submit(exchange, upstream.adapter)
        observer.lifecycle("gw-up", upstream.adapter, c.EVENT_DOWN, "connect timeout")
        assert await observer.drain()

    asyncio.run(run())
    observer.close()
    assert observer.errors == 0
    return [encode_spans([span]).SerializeToString() for span in exporter.get_finished_spans()]


def json_fixture(name: str) -> bytes:
    """An OTLP JSON fixture as the protobuf body its spans would make."""
    return decode((golden.FIXTURES / name).read_bytes(), Encoding("json", JSON)).SerializeToString()


# --- payloads: generated engine-shaped batches -------------------------------------------------------
#: Values the decoder must write exactly as json.dumps does: escapes, unicode, float reprs,
#: NaN and infinities as strings, 64-bit extremes, empty and mixed arrays, an empty AnyValue.
ODD = ["", "quote\" back\\slash", "\x00\x01\x1f\x7f tab\t nl\n cr\r \b \f", "é ☃ 𝄞 \u2028", "</script>",
       0.1, 1e16, 9999999999999998.0, 1e-7, 5e-324, 1.7976931348623157e308, -0.0, 0.0, 2.5, float("nan"),
       float("inf"), float("-inf"), 0, -1, 2**63 - 1, -(2**63), True, False, None, [], [1, 2, 3],
       ["a", "", "☃"], [1.5, float("nan")], [True, False], [1, "s", 2.5, True, None], [None]]


#: Declared limit ranks (tokentrace.cache.limit_rank), one per request in turn: only a non-negative
#: int_value is a rank, the rest store NULL (None sends an empty AnyValue).
LIMIT_RANKS = [1, 0, -1, True, 1.0, "1", 2**63 - 1, None]


ODD_KEYS = ["foreign", "", "kéy ☃", "tab\tquote\"back\\slash\x01"]


def set_attributes(span, values: dict) -> None:
    """Append ``values`` as attributes (``set_any``) to a span, event, link, scope or resource."""
    for key, value in values.items():
        set_any(span.attributes.add(key=key).value, value)


def engine_request(rng: random.Random, requests: int = 12, odd: bool = True) -> ExportTraceServiceRequest:
    """Engine-shaped spans over a few instances (the shape of bench/synth.py, plus every contract
    span and event kind), with foreign attributes of ``ODD`` values when ``odd``."""
    request = ExportTraceServiceRequest()
    clock = 1_700_000_000_000_000_000 + rng.randrange(10**12)
    for instance in range(rng.randint(1, 3)):
        resource_spans = request.resource_spans.add()
        set_attributes(resource_spans.resource, {
            c.SERVICE_NAME: "tokentrace-engine", c.SERVICE_INSTANCE_ID: f"inst-{instance}", c.HOST_NAME: "h☃",
            c.ENGINE: rng.choice([c.ENGINE_MLX, c.ENGINE_VLLM]), c.MODEL: "m", "telemetry.sdk.version": "1.45.2"})
        resource_spans.resource.dropped_attributes_count = rng.choice([0, 3])
        scope_spans = resource_spans.scope_spans.add()
        scope_spans.scope.name, scope_spans.scope.version = "tokentrace", rng.choice(["", "0.1"])
        scope_spans.scope.dropped_attributes_count = rng.choice([0, 1])
        set_attributes(scope_spans.scope, {"scope.attribute": rng.choice(ODD)} if odd else {})
        for n in range(requests):
            clock += rng.randrange(10**6, 10**8)
            rid = f"req-{instance}-{n}" if n % 5 else ""  # an empty request id: the span id stands in
            add = _span_adder(scope_spans, rng, rng.randbytes(16), clock, rid, odd)
            prompt = [rng.getrandbits(63) - 2**62 for _ in range(rng.randrange(0, 40))]
            root = add(c.SPAN_REQUEST, None, {
                c.SESSION_ID: "s", c.ENDPOINT: "/v1/chat/completions", c.MAX_TOKENS: 256, c.STREAMED: True,
                c.CLIENT_DISCONNECTED: False, c.HTTP_STATUS: 200, c.INPUT_TOKENS: 40, c.OUTPUT_TOKENS: 9.0,
                c.FINISH_REASONS: rng.choice([["length"], ["stop", "x"], "stop", [""], [None]]), c.QUEUE_MS: 1.25,
                c.LOAD_WAIT_MS: 0, c.PREFILL_MS: 1e-3, c.TTFT_MS: 10**10, c.TPOT_MS: 0.3, c.ERROR_TYPE: "",
                c.OBSERVER: "x"})
            add(c.SPAN_QUEUE, root, {c.QUEUE_DEPTH: rng.randrange(4), c.QUEUE_RUNNING: 2.0, c.MAX_BATCH: "8"})
            add(c.SPAN_LOAD_WAIT, root, {c.LOAD_ID: "load-1"})
            add(c.SPAN_CACHE_LOOKUP, root, {
                c.CACHE_PROMPT_TOKENS: 40, c.CACHE_MATCH: c.MATCH_PREFIX, c.CACHE_BLOCK_HASHES: prompt,
                c.SEGMENT_ROLES: ["system", "user", ""], c.SEGMENT_STARTS: [0, 10], c.SEGMENT_ENDS: [10, 40, 50, 60],
                c.SEGMENT_HASHES: [], c.SEGMENT_SNIPPETS: ["sys\n", None], c.CACHE_UNIT: c.UNIT_ENTRY})
            prefill = add(c.SPAN_PREFILL, root, {c.PREFILL_TOKENS: 40})
            for k in range(rng.randrange(3)):
                add(c.SPAN_PREFILL_CHUNK, prefill, {c.CHUNK_OFFSET: k * 20, c.CHUNK_TOKENS: 20, c.CHUNK_BATCH_SIZE: 1})
            add(c.SPAN_DECODE, root, {c.DECODE_STEP_OFFSETS: [i * 1_000 for i in range(rng.randrange(0, 50))],
                                      c.ITL_P50_MS: 1.5})
            evict = {c.ENTRY_FINGERPRINT: 7, c.ENTRY_TOKENS: 32.0, c.EVICT_REASON: "max_bytes", c.ENTRY_REQUEST_ID: "",
                     c.CACHE_ENTRIES: 3}
            add(c.SPAN_CACHE_INSERT, root, {c.CACHE_BLOCK_HASHES: prompt, c.ENTRY_FINGERPRINT: prompt[-1] if prompt
                                            else 0.5, c.CACHE_MAX_BYTES: 1 << 40,
                                            c.CACHE_LIMIT_RANK: LIMIT_RANKS[n % len(LIMIT_RANKS)]},
                events=[(c.EVENT_CACHE_EVICT, evict)] * rng.randrange(3))
        window = [0, 1_000, 2_000]
        add(c.SPAN_ENGINE_STEPS, None, {
            c.STEPS_START_OFFSETS: window, c.STEPS_DURATIONS: [900, 900], c.STEPS_PREFILL_SEQS: [1, 0, 2],
            c.STEPS_DECODE_SEQS: [0, 1], c.STEPS_PREFILL_TOKENS: [16], c.STEPS_DECODE_TOKENS: [0, 1, 1],
            c.STEPS_REQUESTS: ["r-a", "", "r-c"], c.STEPS_MEMBERS: [0, 2, 1, 0, 2, 1]})
        add(c.SPAN_HEARTBEAT, None, {c.QUEUE_DEPTH: 1, c.CACHE_ENTRIES: 3, c.MEMORY_BYTES: 1 << 30,
                                     c.CACHE_UNIT: "entry", c.CACHE_BLOCK_HASHES: [1, 2]})
        load = add(c.SPAN_MODEL_LOAD, None, {c.LOAD_ID: "load-1", c.LOAD_LAZY: True, c.MODEL_PATH: "/m"},
                   events=[(c.EVENT_READY, {}), (c.EVENT_STARTED, {c.LOAD_ID: None})])
        add(c.SPAN_LOAD_WEIGHTS, load, {c.LOAD_ID: "load-1", c.LOAD_BYTES: 10**9})
        add(c.SPAN_LIFECYCLE, None, {}, events=[(c.EVENT_FIRST_RESPONSE, {c.LOAD_ID: "load-1"}), ("other", {"k": 1})])
        add(c.SPAN_ROUTE, None, {c.ROUTE_CANDIDATES: ["a", "", None], c.ROUTE_SCORES: [1, 2.5, "x", True, None],
                                 c.ROUTE_CHOICE: "a", c.ROUTE_SKIPPED: "not a list", c.GATEWAY_WAIT_MS: 0.5})
        add("wide", None, {f"wide.{i}": i for i in range(rng.choice([0, 40, 300]))})  # then narrow ones again
        add("narrow", None, {"k": "v"})
    return request


def _span_adder(scope_spans, rng: random.Random, trace_id: bytes, clock: int, rid: str, odd: bool):
    def add(name: str, parent, attributes: dict, events=()):
        start = clock + rng.randrange(1_000)
        span = scope_spans.spans.add(trace_id=trace_id, span_id=rng.randbytes(8), name=name,
                                     parent_span_id=parent.span_id if parent is not None else b"",
                                     kind=rng.choice([0, 1, 2, 5]), start_time_unix_nano=start,
                                     end_time_unix_nano=start + rng.choice([0, 1, 10**9]))
        set_attributes(span, {c.REQUEST_ID: rid, **attributes})
        if odd:
            set_attributes(span, {f"{rng.choice(ODD_KEYS)}.{i}": rng.choice(ODD) for i in range(rng.randrange(4))})
            if rng.random() < 0.2:
                span.status.code, span.status.message = rng.choice([(2, "boom ☃"), (1, ""), (99, "x")])
                span.trace_state = "k=v"
                span.dropped_attributes_count, span.dropped_events_count = rng.choice([(0, 3), (2**32 - 1, 0)])
            if rng.random() < 0.1:
                link = span.links.add(trace_id=rng.randbytes(rng.choice([16, 3])), span_id=rng.randbytes(8),
                                      trace_state=rng.choice(["", "a=b"]), dropped_attributes_count=rng.choice([0, 2]),
                                      flags=rng.choice([0, 0x301]))
                set_attributes(link, {"la": rng.choice(ODD)} if rng.random() < 0.5 else {})
                span.dropped_links_count = 1
        for event_name, event_attributes in events:
            event = span.events.add(name=event_name, time_unix_nano=start + 5,
                                    dropped_attributes_count=rng.choice([0, 0, 1]))
            set_attributes(event, event_attributes)
        return span

    return add


def one_span(name: str = c.SPAN_REQUEST, attributes: dict | None = None, events=(),
             **fields) -> ExportTraceServiceRequest:
    """A request of one span (an mlx-lm instance's) with ``attributes`` and span ``fields``."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    set_attributes(resource_spans.resource,
                   {c.SERVICE_NAME: "svc", c.SERVICE_INSTANCE_ID: "inst", c.ENGINE: c.ENGINE_MLX})
    span = resource_spans.scope_spans.add().spans.add(trace_id=bytes(range(16)), span_id=bytes(range(8)), name=name,
                                                      start_time_unix_nano=10**18, end_time_unix_nano=10**18 + 5)
    set_attributes(span, {c.REQUEST_ID: "r-1", **(attributes or {})})
    for key, value in fields.items():
        setattr(span, key, value)
    for event_name, event_attributes in events:
        set_attributes(span.events.add(name=event_name, time_unix_nano=10**18), event_attributes)
    return request


def span_suffix(extra: bytes, request: ExportTraceServiceRequest | None = None) -> bytes:
    """The body of ``request`` (``one_span()`` by default) with ``extra`` appended to its span's own bytes."""
    resource_spans = (request or one_span()).resource_spans[0]
    span = resource_spans.scope_spans[0].spans[0].SerializeToString() + extra
    scope = b"\x12" + varint(len(span)) + span
    part = type(resource_spans)(resource=resource_spans.resource).SerializeToString() + b"\x12" + varint(
        len(scope)) + scope
    return b"\x0a" + varint(len(part)) + part


def span_of(request):
    return request.resource_spans[0].scope_spans[0].spans[0]
