"""Issue 11 acceptance: a seeded, bounded fuzz of the receiver. 2,000 bodies (protobuf and JSON, gzip
and plain), mutated from valid contract spans, go to one real collector from 4 threads, with a valid
canary batch between every few of them. Nothing may answer 500, nothing permanent may answer 503,
the writer must survive, and every canary must be stored exactly once.

Mutation-based with ``random.Random(seed)`` (no extra dependency): structured mutations of the
protobuf message (extreme times, attributes of every type, NaN, mixed arrays, bad ids, long
names, deep nesting) and of its JSON form (numbers as strings, wrong types, deep arrays), then
byte-level ones (flips, truncation, splices) on a share of them.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import json
import os
import random
import time

import httpx
import pytest
from google.protobuf import json_format
from harness_collector import CollectorProcess
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from test_collector_errors import make_request
from test_collector_validation import BASE, contract_request, set_any

from tokentrace import contract as c

SEED = 20261201
BODIES = 2000
CANARY_EVERY = 10
PB, JSON = "application/x-protobuf", "application/json"
_EXTREME_INTS = [0, 1, -1, 2**31, 2**63 - 1, -(2**63), 2**62]
_EXTREME_TIMES = [0, 1, BASE, 2**63 - 1, 2**63, 2**64 - 1]
_ODD_VALUES = [float("nan"), float("inf"), float("-inf"), 1e308, -0.0, 2.5, True, "", "x" * 300, "☃", [1, "s", 2.5],
               [], [True, None], 2**63 - 1, -(2**63)]
_KEYS = [c.QUEUE_MS, c.LOAD_WAIT_MS, c.PREFILL_MS, c.DECODE_MS, c.TTFT_MS, c.TPOT_MS, c.INPUT_TOKENS,
         c.CACHED_TOKENS, c.OUTPUT_TOKENS, c.ENTRY_FINGERPRINT, c.ENTRY_TOKENS, c.ENTRY_BYTES, c.CACHE_BLOCK_HASHES,
         c.DECODE_STEP_OFFSETS, c.STEPS_START_OFFSETS, c.STEPS_MEMBERS, c.STEPS_PREFILL_SEQS, c.STEPS_REQUESTS,
         c.SEGMENT_ROLES, c.SEGMENT_STARTS, c.REQUEST_ID, c.STREAMED, c.FINISH_REASONS, c.HTTP_STATUS,
         c.CHUNK_OFFSET, c.QUEUE_DEPTH, c.CACHE_ENTRIES, "foreign.key"]


def _seeds() -> list[ExportTraceServiceRequest]:
    """Valid contract spans of every typed kind: the material mutations start from."""
    evict = {c.ENTRY_FINGERPRINT: 7, c.ENTRY_TOKENS: 32, c.ENTRY_BYTES: 4096, c.EVICT_REASON: "max_bytes"}
    return [
        contract_request(c.SPAN_REQUEST, {c.QUEUE_MS: 1.5, c.PREFILL_MS: 20.0, c.DECODE_MS: 30.0, c.INPUT_TOKENS: 40,
                                          c.OUTPUT_TOKENS: 5, c.STREAMED: True}, request_id="fz"),
        contract_request(c.SPAN_ENGINE_STEPS, {
            c.STEPS_START_OFFSETS: [0, 1000], c.STEPS_DURATIONS: [900, 900], c.STEPS_PREFILL_SEQS: [1, 0],
            c.STEPS_DECODE_SEQS: [0, 1], c.STEPS_PREFILL_TOKENS: [16, 0], c.STEPS_DECODE_TOKENS: [0, 1],
            c.STEPS_REQUESTS: ["r-a"], c.STEPS_MEMBERS: [0, 0]}),
        contract_request(c.SPAN_DECODE, {c.DECODE_STEP_OFFSETS: [0, 10, 20, 30]}, request_id="fz"),
        contract_request(c.SPAN_CACHE_INSERT, {c.CACHE_BLOCK_HASHES: [11, 12, 13], c.ENTRY_FINGERPRINT: 13},
                         events=[(c.EVENT_CACHE_EVICT, evict)], request_id="fz"),
        contract_request(c.SPAN_CACHE_LOOKUP, {c.CACHE_BLOCK_HASHES: [11, 12], c.SEGMENT_ROLES: ["system", "user"],
                                               c.SEGMENT_STARTS: [0, 16], c.SEGMENT_ENDS: [16, 40],
                                               c.SEGMENT_HASHES: [5, 6]}, request_id="fz"),
        contract_request(c.SPAN_HEARTBEAT, {c.QUEUE_DEPTH: 1, c.CACHE_ENTRIES: 3, c.MEMORY_BYTES: 1 << 30}),
        make_request(3, name="foreign"),
    ]


def _mutate_message(request: ExportTraceServiceRequest, rng: random.Random) -> None:
    span = request.resource_spans[0].scope_spans[0].spans[0]
    for _ in range(rng.randint(1, 3)):
        choice = rng.randrange(9)
        if choice == 0:
            span.start_time_unix_nano = rng.choice(_EXTREME_TIMES)
            span.end_time_unix_nano = rng.choice([*_EXTREME_TIMES, span.start_time_unix_nano])
        elif choice == 1:
            value = rng.choice(_ODD_VALUES + _EXTREME_INTS + [[rng.choice(_EXTREME_INTS) for _ in range(3)]])
            set_any(span.attributes.add(key=rng.choice(_KEYS)).value, value)
        elif choice == 2 and span.events:
            span.events[0].time_unix_nano = rng.choice(_EXTREME_TIMES)
        elif choice == 3:
            span.trace_id = os.urandom(rng.choice([0, 5, 16, 17]))
            span.span_id = os.urandom(rng.choice([0, 3, 8, 9]))
        elif choice == 4:
            span.name = rng.choice([c.SPAN_ENGINE_STEPS, c.SPAN_REQUEST, c.SPAN_DECODE, "", "n" * 5000])
        elif choice == 5:
            nested = span.attributes.add(key="nested").value
            for _ in range(rng.randint(1, 40)):
                nested = nested.kvlist_value.values.add(key="k").value
            nested.string_value = "leaf"
        elif choice == 6:
            link = span.links.add(trace_id=os.urandom(16), span_id=os.urandom(8), trace_state="a=b")
            set_any(link.attributes.add(key="la").value, rng.choice(_ODD_VALUES))
        elif choice == 7:
            span.status.message = "m" * rng.choice([0, 10, 5000])
            span.status.code = rng.choice([0, 1, 2, 99])
        else:
            span.kind = rng.choice([0, 1, 2, 5, 42])


def _mutate_json(text: str, rng: random.Random) -> str:
    choice = rng.randrange(6)
    if choice == 0:
        return text.replace('"startTimeUnixNano": "', '"startTimeUnixNano": "1844674407370955161', 1)
    if choice == 1:
        return text.replace('"intValue": "', '"intValue": "99999999999999999999', 1)
    if choice == 2:
        depth = rng.choice([50, 3000])
        return text[:-1] + ', "x": ' + "[" * depth + "]" * depth + "}"
    if choice == 3:
        return text.replace('"doubleValue": ', '"doubleValue": "NaN", "y": ', 1)
    if choice == 4:
        return text.replace('"spans": [', '"spans": [17, ', 1)
    return text.replace('"name": ', '"name": 5, "n": ', 1)


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    data = bytearray(data)
    choice = rng.randrange(3)
    if choice == 0 and data:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif choice == 1:
        data = data[:rng.randrange(len(data) + 1)]
    else:
        at = rng.randrange(len(data) + 1)
        data[at:at] = os.urandom(rng.randint(1, 16))
    return bytes(data)


def fuzz_bodies(seed: int, count: int) -> list[tuple[bytes, str, dict]]:
    """``count`` (body, content type, headers), deterministic for ``seed``."""
    rng = random.Random(seed)
    seeds = _seeds()
    bodies = []
    for _ in range(count):
        request = ExportTraceServiceRequest()
        request.CopyFrom(rng.choice(seeds))
        _mutate_message(request, rng)
        if rng.random() < 0.5:
            data, content_type = request.SerializeToString(), PB
        else:
            text = json_format.MessageToJson(request, indent=1)
            text = _to_otlp_json(text, request) if rng.random() < 0.8 else text
            data, content_type = (_mutate_json(text, rng) if rng.random() < 0.5 else text).encode(), JSON
        if rng.random() < 0.2:
            data = _mutate_bytes(data, rng)
        headers = {}
        if rng.random() < 0.4:
            data, headers = gzip.compress(data, mtime=0), {"Content-Encoding": "gzip"}
            if rng.random() < 0.1:
                data = _mutate_bytes(data, rng)
        bodies.append((data, content_type, headers))
    return bodies


def _to_otlp_json(text: str, request: ExportTraceServiceRequest) -> str:
    """protobuf's JSON writes bytes as base64; OTLP JSON writes trace and span ids as hex."""
    document = json.loads(text)
    for resource_spans, message in zip(document.get("resourceSpans", []), request.resource_spans, strict=False):
        for scope_spans, scope_message in zip(resource_spans.get("scopeSpans", []), message.scope_spans,
                                              strict=False):
            for span, span_message in zip(scope_spans.get("spans", []), scope_message.spans, strict=False):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = getattr(span_message, {"traceId": "trace_id", "spanId": "span_id",
                                                           "parentSpanId": "parent_span_id"}[key]).hex()
                for link, link_message in zip(span.get("links", []), span_message.links, strict=False):
                    link["traceId"], link["spanId"] = link_message.trace_id.hex(), link_message.span_id.hex()
    return json.dumps(document, indent=1)


@pytest.fixture
def collector(tmp_path):
    process = CollectorProcess(tmp_path, "--max-body-bytes", "2000000", "--max-attribute-length", "4096")
    process.start()
    yield process
    process.stop()


def test_fuzzed_bodies_never_stop_storage_and_every_canary_is_stored_once(collector):
    started = time.monotonic()
    bodies = fuzz_bodies(SEED, BODIES)
    items = []
    for index, body in enumerate(bodies):
        items.append(("fuzz", index, body))
        if index % CANARY_EVERY == 0:
            canary = make_request(2, name=f"canary-{index}")
            items.append(("canary", index, (canary.SerializeToString(), PB, {})))

    def send(client: httpx.Client, item) -> tuple[str, int, int, str]:
        kind, index, (data, content_type, headers) = item
        response = client.post("/v1/traces", content=data, headers={"Content-Type": content_type, **headers})
        return kind, index, response.status_code, response.text[:200]

    statuses: dict[int, int] = {}
    with httpx.Client(base_url=collector.url, timeout=60) as client, \
            concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda item: send(client, item), items))
    for kind, index, status, text in answers:
        statuses[status] = statuses.get(status, 0) + 1
        assert status != 500, (kind, index, text)
        assert status in (200, 400, 413, 415), (kind, index, status, text)  # no 503: nothing here passes
        if kind == "canary":
            assert status == 200, (index, text)
    assert statuses.get(400, 0) > 200 and statuses.get(200, 0) > 1000, statuses  # the mutations bite, not all

    health = collector.health()
    assert health["status"] == "ok", health
    assert collector.stop() == 0
    canaries = len(range(0, BODIES, CANARY_EVERY))
    rows = collector.sql("SELECT name, count(*) FROM spans WHERE name LIKE 'canary-%' GROUP BY name")
    assert len(rows) == canaries and {count for _, count in rows} == {2}
    elapsed = time.monotonic() - started
    assert elapsed < 60, f"the fuzz run took {elapsed:.0f} s"
