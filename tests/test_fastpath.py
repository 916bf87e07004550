"""Issue 17: the compiled decoder (collector/fastpath.py) gives exactly the Columns of the Python
normalizer, or None (the Python path then decides). Differential: every payload here goes through
both, and a decoded one must equal ``normalize(...).columns()`` in every table, origin, key and
counter. Payloads come from software we did not write (the OpenTelemetry SDK encoding the golden
traces, vLLM's native spans) and from our own shims (the MLX engine's span builder, the gateway's
observer), from a generator of engine-shaped batches with odd but legal values, and from hostile
input: the fuzz generator's structured and byte-level mutations, truncations, bit flips, huge
length prefixes and deep nesting. The ordinary payloads must take the C path: a decoder that always
gave up would fail here."""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import time

import golden
import numpy as np
import pyarrow as pa
import pytest
from google.protobuf.message import DecodeError
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_collector_fuzz import SEED, _mutate_bytes, _mutate_message, _seeds, fuzz_bodies
from test_collector_validation import set_any

from tokentrace import contract as c
from tokentrace.collector import fastpath
from tokentrace.collector.columns import SCHEMAS, Columns
from tokentrace.collector.ingest import parse
from tokentrace.collector.normalize import normalize
from tokentrace.collector.otlp import JSON, PROTOBUF, Encoding, decode, decompress
from tokentrace.errors import PayloadError

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
        if not mine.equals(table):
            for column in table.column_names:
                a, b = mine.column(column).to_pylist(), table.column(column).to_pylist()
                row = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if repr(x) != repr(y)), None)
                assert a == b, f"{name}.{column} row {row}: {a[row]!r} != {b[row]!r}"
            raise AssertionError(f"{name} differs")
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


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


# --- payloads: the SDK, our shims --------------------------------------------------------------------
def sdk_spans(resource: dict, build) -> bytes:
    """The protobuf body the SDK's OTLP exporter sends for the spans ``build(tracer)`` makes."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(resource))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    build(provider.get_tracer("tokentrace.tests.fastpath", "1.0"))
    provider.shutdown()
    return encode_spans(exporter.get_finished_spans()).SerializeToString()


def mlx_payload(seed: int) -> bytes:
    """Every record kind of the MLX engine, built into spans by its own SpanBuilder."""
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
            record.insertion = InsertRecord(tokens, 8192, 4, 10_000, 16, 1 << 30, evictions)
            record.insert_start_ns, record.insert_end_ns = record.finish_ns, record.finish_ns + 50
            record.first_content_ns, record.end_ns = at + 1_200, record.finish_ns + 100
            builder.build(record)
        window = StepWindow([t0 + i * 100 for i in range(8)], [90] * 8, [1, 0] * 4, [0, 1] * 4, [40, 0] * 4,
                            [0, 1] * 4, [f"mlx-{seed}-{i // 2}" for i in range(8)])
        builder.build(window)
        builder.build(HeartbeatRecord(t0 + 5_000_000, 1, 2, 8, 3, 300_000, 16, 1 << 30, 1000, 10**9))

    return sdk_spans({c.SERVICE_NAME: "tokentrace-engine", c.SERVICE_INSTANCE_ID: f"mlx-{seed}",
                      c.ENGINE: c.ENGINE_MLX, c.ENGINE_VERSION: "0.32.0", c.MODEL: "tiny"}, build)


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


def _attrs(span, values: dict) -> None:
    for key, value in values.items():
        set_any(span.attributes.add(key=key).value, value)


def engine_request(rng: random.Random, requests: int = 12, odd: bool = True) -> ExportTraceServiceRequest:
    """Engine-shaped spans over a few instances (the shape of bench/synth.py, plus every contract
    span and event kind), with foreign attributes of ``ODD`` values when ``odd``."""
    request = ExportTraceServiceRequest()
    clock = 1_700_000_000_000_000_000 + rng.randrange(10**12)
    for instance in range(rng.randint(1, 3)):
        resource_spans = request.resource_spans.add()
        _attrs(resource_spans.resource, {c.SERVICE_NAME: "tokentrace-engine", c.SERVICE_INSTANCE_ID: f"inst-{instance}",
                                         c.ENGINE: rng.choice([c.ENGINE_MLX, c.ENGINE_VLLM]), c.HOST_NAME: "h☃",
                                         c.MODEL: "m", "telemetry.sdk.version": "1.45.2"})
        scope_spans = resource_spans.scope_spans.add()
        scope_spans.scope.name, scope_spans.scope.version = "tokentrace", rng.choice(["", "0.1"])
        for n in range(requests):
            clock += rng.randrange(10**6, 10**8)
            add = _span_adder(scope_spans, rng, rng.randbytes(16), clock, f"req-{instance}-{n}", odd)
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
                                            else 0.5, c.CACHE_MAX_BYTES: 1 << 40},
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
    return request


def _span_adder(scope_spans, rng: random.Random, trace_id: bytes, clock: int, rid: str, odd: bool):
    def add(name: str, parent, attributes: dict, events=()):
        start = clock + rng.randrange(1_000)
        span = scope_spans.spans.add(trace_id=trace_id, span_id=rng.randbytes(8), name=name,
                                     parent_span_id=parent.span_id if parent is not None else b"",
                                     kind=rng.choice([0, 1, 2, 5]), start_time_unix_nano=start,
                                     end_time_unix_nano=start + rng.choice([0, 1, 10**9]))
        _attrs(span, {c.REQUEST_ID: rid, **attributes})
        if odd:
            _attrs(span, {f"foreign.{i}": rng.choice(ODD) for i in range(rng.randrange(4))})
            if rng.random() < 0.2:
                span.status.code, span.status.message = rng.choice([(2, "boom ☃"), (1, ""), (99, "x")])
                span.trace_state = "k=v"
                span.dropped_attributes_count, span.dropped_events_count = rng.choice([(0, 3), (2**32 - 1, 0)])
            if rng.random() < 0.1:
                link = span.links.add(trace_id=rng.randbytes(rng.choice([16, 3])), span_id=rng.randbytes(8),
                                      trace_state=rng.choice(["", "a=b"]), dropped_attributes_count=rng.choice([0, 2]))
                _attrs(link, {"la": rng.choice(ODD)} if rng.random() < 0.5 else {})
                span.dropped_links_count = 1
        for event_name, event_attributes in events:
            event = span.events.add(name=event_name, time_unix_nano=start + 5,
                                    dropped_attributes_count=rng.choice([0, 0, 1]))
            _attrs(event, event_attributes)
        return span

    return add


# --- tests --------------------------------------------------------------------------------------------
def test_the_decoder_is_built_and_writes_the_columns_of_tables_py():
    assert fastpath.unavailable() is None
    assert fastpath.enabled()
    empty = taken(b"")
    assert empty.spans == 0 and not empty.tables and empty.keys.dtype == np.uint64


def test_sdk_encoded_golden_traces_take_the_fast_path():
    fixture = golden.load("golden_engine_trace.json")
    for base in (1_700_000_000_000_000_000, time.time_ns()):
        body, _ = golden.encode(fixture, base)
        got = taken(body)
        assert {"spans", "requests", "phases", "decode_steps", "prefix_blocks", "steps", "heartbeats",
                "model_loads", "load_stages", "cache_evictions"} <= set(got.tables)
    for line in (golden.FIXTURES / "demo_trace.jsonl").read_bytes().splitlines():
        taken(decode(line, Encoding("json", JSON)).SerializeToString())


def test_payloads_of_our_shims_take_the_fast_path():
    for seed in range(3):
        got = taken(mlx_payload(seed))
        assert {"requests", "segments", "cache_evictions", "instance_events", "load_stages", "steps"} <= set(got.tables)
    tables = set()
    for body in gateway_payloads():
        tables |= set(taken(body).tables)
    assert {"routes", "requests", "instance_events"} <= tables


def test_generated_engine_batches_with_odd_values_take_the_fast_path():
    rng = random.Random(SEED)
    for _ in range(30):
        got = taken(engine_request(rng).SerializeToString())
        assert got.count("cache_lookups") and got.count("routes") and got.count("instance_events")
    batch = engine_request(rng, requests=300, odd=False).SerializeToString()  # a big one: thousands of spans
    assert taken(batch).spans >= 2400


def one_span(name: str = c.SPAN_REQUEST, attributes: dict | None = None, events=(),
             **fields) -> ExportTraceServiceRequest:
    """A request of one span (an mlx-lm instance's) with ``attributes`` and span ``fields``."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    _attrs(resource_spans.resource, {c.SERVICE_NAME: "svc", c.SERVICE_INSTANCE_ID: "inst", c.ENGINE: c.ENGINE_MLX})
    span = resource_spans.scope_spans.add().spans.add(trace_id=bytes(range(16)), span_id=bytes(range(8)), name=name,
                                                      start_time_unix_nano=10**18, end_time_unix_nano=10**18 + 5)
    _attrs(span, {c.REQUEST_ID: "r-1", **(attributes or {})})
    for key, value in fields.items():
        setattr(span, key, value)
    for event_name, event_attributes in events:
        _attrs(span.events.add(name=event_name, time_unix_nano=10**18), event_attributes)
    return request


def _edit(change):
    """The body of ``one_span()`` after ``change(request)``."""
    request = one_span()
    change(request)
    return request.SerializeToString()


def _span_suffix(extra: bytes) -> bytes:
    """The body of ``one_span()`` with ``extra`` appended to the span's own bytes."""
    resource_spans = one_span().resource_spans[0]
    span = resource_spans.scope_spans[0].spans[0].SerializeToString() + extra
    scope = b"\x12" + _varint(len(span)) + span
    part = type(resource_spans)(resource=resource_spans.resource).SerializeToString() + b"\x12" + _varint(
        len(scope)) + scope
    return b"\x0a" + _varint(len(part)) + part


def _resource_twice() -> bytes:
    """A ResourceSpans whose resource field comes twice: protobuf merges the two."""
    resource_spans = one_span().resource_spans[0]
    again = type(resource_spans)(resource=resource_spans.resource).SerializeToString()
    part = resource_spans.SerializeToString() + again
    return b"\x0a" + _varint(len(part)) + part


def _event_key_twice(request) -> None:
    event = _span_of(request).events.add(name="e", time_unix_nano=10**18)
    for value in (1, 2):
        event.attributes.add(key="k").value.int_value = value


def _span_of(request):
    return request.resource_spans[0].scope_spans[0].spans[0]


_LONG = "x" * 100
#: (caption, body, length limit): payloads the normalizer refuses, changes or counts, and rare
#: encodings, each left to the Python path.
LEFT_TO_PYTHON = [
    ("a span name longer than the limit", one_span(name="llm." + _LONG).SerializeToString(), 50),
    ("an attribute value longer than the limit", one_span(attributes={"k": _LONG}).SerializeToString(), 50),
    ("an array element longer than the limit", one_span(attributes={"k": ["a", _LONG]}).SerializeToString(), 50),
    ("a status message longer than the limit", _edit(lambda r: setattr(_span_of(r).status, "message", _LONG)), 50),
    ("a resource value longer than the limit", _edit(lambda r: _attrs(r.resource_spans[0].resource, {"k": _LONG})),
     50),
    ("a 5-byte trace id", one_span(trace_id=b"12345").SerializeToString(), MAX),
    ("a 3-byte parent span id", one_span(parent_span_id=b"123").SerializeToString(), MAX),
    ("an end before the start", one_span(end_time_unix_nano=1).SerializeToString(), MAX),
    ("an end beyond 2^63", one_span(end_time_unix_nano=2**63).SerializeToString(), MAX),
    ("an event beyond 2^63", _edit(lambda r: _span_of(r).events.add(name="e", time_unix_nano=2**64 - 1)), MAX),
    ("an attribute key sent twice", _edit(lambda r: _attrs(_span_of(r), {c.REQUEST_ID: "again"})), MAX),
    ("an event attribute key sent twice", _edit(_event_key_twice), MAX),
    ("a kvlist value", _edit(lambda r: _span_of(r).attributes.add(key="kv").value.kvlist_value.values.add(key="a")),
     MAX),
    ("a bytes value", _edit(lambda r: setattr(_span_of(r).attributes.add(key="b").value, "bytes_value", b"\x01")),
     MAX),
    ("a nested array", one_span(attributes={"k": [[1]]}).SerializeToString(), MAX),
    ("a legacy usage name", one_span(attributes={"gen_ai.usage.prompt_tokens": 5}).SerializeToString(), MAX),
    ("vLLM latency seconds", one_span(attributes={"gen_ai.latency.time_in_queue": 0.5}).SerializeToString(), MAX),
    ("a non-string instance id", _edit(lambda r: setattr(r.resource_spans[0].resource.attributes[1].value,
                                                         "int_value", 7)), MAX),
    ("a NaN duration", one_span(attributes={c.QUEUE_MS: float("nan")}).SerializeToString(), MAX),
    ("a non-integral eviction count", one_span(c.SPAN_CACHE_INSERT, events=[
        (c.EVENT_CACHE_EVICT, {c.ENTRY_TOKENS: 2.5})]).SerializeToString(), MAX),
    ("a negative decode offset", one_span(c.SPAN_DECODE, {c.DECODE_STEP_OFFSETS: [0, -1]}).SerializeToString(), MAX),
    ("block hashes as strings", one_span(c.SPAN_CACHE_LOOKUP, {c.CACHE_BLOCK_HASHES: ["1"]}).SerializeToString(), MAX),
    ("a step member out of range", one_span(c.SPAN_ENGINE_STEPS, {
        c.STEPS_START_OFFSETS: [0], c.STEPS_MEMBERS: [3], c.STEPS_REQUESTS: ["a"]}).SerializeToString(), MAX),
    ("a request id that is an int", one_span(attributes={c.REQUEST_ID: 5}).SerializeToString(), MAX),
    ("finish reasons []", one_span(attributes={c.FINISH_REASONS: []}).SerializeToString(), MAX),
    ("vLLM's native request span", one_span("llm_request").SerializeToString(), MAX),
    ("resource entity refs", _edit(lambda r: r.resource_spans[0].resource.entity_refs.add(type="service")), MAX),
    ("a span name sent twice", _span_suffix(b"\x2a\x01x"), MAX),
    ("a status sent twice", _span_suffix(b"\x7a\x00\x7a\x00"), MAX),
    ("a group field", _span_suffix(b"\xa3\x01\xa4\x01"), MAX),
    ("kind sent as bytes", _span_suffix(b"\x32\x01x"), MAX),
    ("a resource sent twice", _resource_twice(), MAX),
    ("invalid UTF-8 in a schema url the normalizer never reads",
     _edit(lambda r: setattr(r.resource_spans[0].scope_spans[0], "schema_url", "@@@")).replace(b"@@@", b"\xff\xfe@"),
     MAX),
    ("invalid UTF-8 in a scope attribute",
     _edit(lambda r: _attrs(r.resource_spans[0].scope_spans[0].scope, {"k": "@@@"})).replace(b"@@@", b"\xed\xa0\x80"),
     MAX),
    ("a surrogate in a span name", one_span(name="@@@").SerializeToString().replace(b"@@@", b"\xed\xb0\x80"), MAX),
]


@pytest.mark.parametrize(("caption", "body", "limit"), LEFT_TO_PYTHON, ids=[case[0] for case in LEFT_TO_PYTHON])
def test_what_the_decoder_leaves_to_the_python_path(caption, body, limit):
    assert fastpath.decode(body, limit) is None


def test_field_order_and_unknown_fields_do_not_change_the_columns():
    """Protobuf allows fields in any order and unknown fields anywhere (of every wire type)."""
    request = engine_request(random.Random(7), requests=3)
    unknown = b"\xf8\x01\x05" + b"\x81\x02" + bytes(8) + b"\x8a\x02\x02hi" + b"\x95\x02" + bytes(4)
    for resource_spans in request.resource_spans:
        resource_spans.MergeFromString(unknown)
        resource_spans.resource.attributes[0].MergeFromString(unknown)
        resource_spans.resource.attributes[0].value.MergeFromString(unknown)
        for span in resource_spans.scope_spans[0].spans:
            span.MergeFromString(unknown)
            span.status.MergeFromString(unknown)
    plain = taken(request.SerializeToString())
    reordered = b"".join(b"\x0a" + _varint(len(part)) + part
                         for part in map(_scopes_first, request.resource_spans))
    assert_same(taken(reordered + unknown), plain)


def _scopes_first(resource_spans) -> bytes:
    """A ResourceSpans' bytes with its resource after its scope spans, each scope after its spans
    and each span's attributes before its ids and name."""
    scopes = b""
    for scope_spans in resource_spans.scope_spans:
        spans = b""
        for span in scope_spans.spans:
            rest = type(span)()
            rest.CopyFrom(span)
            del rest.attributes[:]
            part = type(span)(attributes=span.attributes).SerializeToString() + rest.SerializeToString()
            spans += b"\x12" + _varint(len(part)) + part
        part = spans + type(scope_spans)(scope=scope_spans.scope).SerializeToString()
        scopes += b"\x12" + _varint(len(part)) + part
    return scopes + type(resource_spans)(resource=resource_spans.resource).SerializeToString()



# --- hostile input -------------------------------------------------------------------------------------
def test_fuzzed_bodies_decode_to_the_reference_or_to_none():
    """The receiver fuzz's bodies (test_collector_fuzz.py: structured and byte-level mutations of
    contract spans), and the same mutations of engine-shaped batches."""
    started, outcomes = time.monotonic(), {True: 0, False: 0}
    for data, content_type, headers in fuzz_bodies(SEED, 1000):
        if content_type != "application/x-protobuf":
            continue
        try:
            data = decompress(data, headers.get("Content-Encoding"), 2_000_000)
        except PayloadError:  # a mutated gzip stream: the receiver's 400, before any decoding
            continue
        outcomes[check(data, 4096) is not None] += 1
    rng = random.Random(SEED)
    for _ in range(200):
        request = engine_request(rng, requests=2)
        _mutate_message(request, rng)
        body = request.SerializeToString()
        outcomes[check(body if rng.random() < 0.5 else _mutate_bytes(body, rng), 4096) is not None] += 1
    for seed in _seeds():
        outcomes[check(seed.SerializeToString()) is not None] += 1
    assert outcomes[True] > 150 and outcomes[False] > 150, outcomes  # both paths exercised
    assert time.monotonic() - started < 60


def _length_prefixes(data: bytes, at: int = 0, end: int | None = None, depth: int = 0) -> list[tuple[int, int]]:
    """(offset, size) of every length prefix in ``data``, reading each length-delimited field as
    a message where it parses as one (a heuristic walk: hostile input needs no exact schema)."""
    end, found = len(data) if end is None else end, []
    while at < end:
        tag, size = _read_varint(data, at)
        if tag is None or tag >> 3 == 0:
            return found
        at += size
        kind = tag & 7
        if kind == 0:
            _, size = _read_varint(data, at)
            at += size or 1
        elif kind in (1, 5):
            at += 8 if kind == 1 else 4
        elif kind == 2:
            length, size = _read_varint(data, at)
            if length is None or at + size + length > end:
                return found
            found.append((at, size))
            if depth < 12:
                found += _length_prefixes(data, at + size, at + size + length, depth + 1)
            at += size + length
        else:
            return found
    return found


def _read_varint(data: bytes, at: int) -> tuple[int | None, int]:
    value = 0
    for i in range(10):
        if at + i >= len(data):
            return None, i
        value |= (data[at + i] & 0x7F) << (7 * i)
        if data[at + i] < 0x80:
            return value, i + 1
    return None, 10


def _nested(depth: int, kind: str) -> bytes:
    """An AnyValue nested ``depth`` deep in arrays or kvlists (protobuf refuses beyond 100)."""
    value = b"\x0a\x04leaf"
    for _ in range(depth):
        if kind == "array":
            value = b"\x2a" + _varint(len(value) + 2) + b"\x0a" + _varint(len(value)) + value
        else:
            pair = b"\x0a\x01k\x12" + _varint(len(value)) + value
            value = b"\x32" + _varint(len(pair) + 2) + b"\x0a" + _varint(len(pair)) + pair
    return value


def _hostile(body: bytes, rng: random.Random) -> bytes:
    choice = rng.randrange(7)
    data = bytearray(body)
    if choice == 0:  # truncated anywhere
        return body[:rng.randrange(len(body) + 1)]
    if choice == 1:  # bits flipped
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    prefixes = _length_prefixes(body)
    if choice in (2, 3) and prefixes:  # a length prefix made huge, or off by a few
        at, size = rng.choice(prefixes)
        length, _ = _read_varint(body, at)
        huge = rng.choice([2**63, 2**64 - 1, 2**31, 2**32 + 5, len(body)])
        new = huge if choice == 2 else max(0, length + rng.choice([-2, -1, 1, 2]))
        return body[:at] + _varint(new) + body[at + size:]
    if choice == 4:  # an 11-byte varint, a zero tag, or a wire type protobuf does not define
        junk = rng.choice([b"\x08" + b"\xff" * 10 + b"\x01", b"\x00\x01", b"\x0e\x01", b"\x0f" + bytes(8), b"\x0c"])
        at = rng.choice(prefixes)[0] if prefixes else 0
        return body[:at] + junk + body[at:]
    if choice == 5:  # random bytes
        return rng.randbytes(rng.randrange(1, 64))
    return bytes(data) * 2  # the request twice: resource spans repeat, which is legal


def test_hostile_bytes_give_the_reference_or_none_and_never_crash():
    rng, started = random.Random(SEED), time.monotonic()
    bodies = [engine_request(rng, requests=2).SerializeToString() for _ in range(6)]
    bodies += [seed.SerializeToString() for seed in _seeds()] + [mlx_payload(9)]
    decoded = sum(check(_hostile(rng.choice(bodies), rng), rng.choice([MAX, 4096, 8])) is not None
                  for _ in range(2500))
    assert 200 < decoded < 2000  # some mutations leave a payload the decoder reproduces, most not
    small = one_span(c.SPAN_DECODE, {c.DECODE_STEP_OFFSETS: [0, 5]}).SerializeToString()
    for end in range(len(small)):  # every truncation of one span
        check(small[:end])
    for depth in (1, 5, 99, 100, 101, 3000):  # nesting, below and beyond protobuf's limit
        for kind in ("array", "kvlist"):
            value = _nested(depth, kind)
            attribute = b"\x0a\x01n\x12" + _varint(len(value)) + value
            body = _span_suffix(b"\x4a" + _varint(len(attribute)) + attribute)
            assert (check(body) is None) == (depth > 1 or kind == "kvlist")  # one level: an array of strings
            assert check(_span_suffix(b"\xa2\x06" + _varint(len(value)) + value)) is not None  # unknown: skipped
    assert time.monotonic() - started < 60


def test_the_length_limit_counts_code_points():
    text = "é☃𝄞" * 10  # 30 code points, 90 bytes of UTF-8
    body = one_span(attributes={"k": text, "a": ["x", text]}).SerializeToString()
    taken(body, 30)
    assert check(body, 29) is None
    assert check(body, 0) is None and check(body, -1) is None
    taken(body, 2**80)


# --- wiring ---------------------------------------------------------------------------------------------
def test_parse_gives_columns_through_the_fast_path_for_protobuf(monkeypatch):
    answers = []
    real = fastpath.decode
    monkeypatch.setattr(fastpath, "decode", lambda body, limit: answers.append(real(body, limit)) or answers[-1])
    request = engine_request(random.Random(5), requests=4)
    body = request.SerializeToString()
    expected = reference(body)
    for data, coding in ((body, None), (gzip.compress(body), "gzip")):
        got = parse(data, PB, coding, 10**8, MAX)
        assert isinstance(got, Columns) and answers[-1] is not None
        assert_same(got, expected)
    text = json.dumps(json.loads(_otlp_json(request))).encode()
    got = parse(text, Encoding("json", JSON), None, 10**8, MAX)
    assert len(answers) == 2  # JSON keeps the Python path
    assert_same(got, normalize(decode(text, Encoding("json", JSON)), MAX).columns())


def _otlp_json(request: ExportTraceServiceRequest) -> str:
    from google.protobuf import json_format
    from test_collector_fuzz import _to_otlp_json

    return _to_otlp_json(json_format.MessageToJson(request), request)


def test_the_environment_variable_turns_the_decoder_off(monkeypatch):
    body = engine_request(random.Random(6), requests=2).SerializeToString()
    monkeypatch.setenv(fastpath.ENV, "0")
    assert fastpath.decode(body, MAX) is None
    assert_same(parse(body, PB, None, 10**8, MAX), reference(body))
    monkeypatch.setenv(fastpath.ENV, "1")
    assert fastpath.decode(body, MAX) is not None


def test_decoded_columns_travel_as_bytes():
    body = engine_request(random.Random(8)).SerializeToString()
    got = taken(body)
    assert_same(Columns.from_bytes(got.to_bytes()), reference(body))
    arrow = pa.Table.from_pydict({"n": [1]})  # the imported tables are ordinary pyarrow tables
    assert pa.concat_tables([got.tables["spans"], got.tables["spans"]]).num_rows == 2 * got.spans and arrow
