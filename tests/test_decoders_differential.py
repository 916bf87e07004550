"""Issue 44 item 6: the two OTLP decoders agree. The compiled decoder (collector/decoding/fastpath.py over
collector/decoding/fastotlp*.c) and the Python normalizer (collector/decoding/normalize.py) must give the same
Columns (every table, origin, key hash and counter: harness_fastpath.assert_same) for every body, or
both refuse it with the same answer: on the bodies real senders sent (tests/fixtures/senders,
captured by its capture.py: the OpenTelemetry Python SDK's OTLP/HTTP exporters, protobuf and JSON,
tokentrace's engine and gateway), and on bodies a property-based generator (hypothesis) builds.

The receive path is compared end to end: ``ingest.parse`` with the compiled decoder and without.
JSON is read by Python alone (otlp.decode); the message it yields is compared as protobuf, and the
generator's JSON must get a message or a PayloadError (a 400), never another exception (a 500:
issue 45's surrogate keys and non-finite kinds). Examples are derandomized and bounded, and
hypothesis keeps no database: every run tries the same bodies."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import zlib
from collections import Counter
from pathlib import Path

import pytest
from google.protobuf.message import DecodeError
from harness_fastpath import assert_same, reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace import contract as c
from tokentrace.collector.decoding import fastpath
from tokentrace.collector.receiver.ingest import parse
from tokentrace.collector.receiver.otlp import JSON, PROTOBUF, Encoding, decode
from tokentrace.errors import PayloadError

SENDERS = Path(__file__).parent / "fixtures" / "senders"
MANIFEST = json.loads((SENDERS / "manifest.json").read_text())
PB_ENCODING, JSON_ENCODING = Encoding("protobuf", PROTOBUF), Encoding("json", JSON)
BODY_LIMIT, MAX = 8 << 20, 65_536
#: Examples per generated test: bounded for CI (about 40 s of CPU in all); TOKENTRACE_DIFF_EXAMPLES
#: runs more (docs/collector.md).
EXAMPLES = int(os.environ.get("TOKENTRACE_DIFF_EXAMPLES", "100"))


def bounded(share: float = 1.0):
    """Reproducible runs: the same examples every time (derandomized), no example database on disk."""
    return settings(derandomize=True, database=None, deadline=None, max_examples=max(1, int(EXAMPLES * share)),
                    print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                            HealthCheck.filter_too_much])


def _outcome(body: bytes, encoding: Encoding, content_encoding: str | None, max_len: int, fast: bool):
    try:
        return parse(body, encoding, content_encoding, BODY_LIMIT, max_len, fast=fast)
    except PayloadError as exc:
        return exc


def agree(body: bytes, encoding: Encoding, content_encoding: str | None = None, max_len: int = MAX) -> bool:
    """The receive path with the compiled decoder gives what it gives without (Columns, or the same
    refusal); True when the compiled decoder itself made the Columns (not left to Python)."""
    fast = _outcome(body, encoding, content_encoding, max_len, True)
    slow = _outcome(body, encoding, content_encoding, max_len, False)
    if isinstance(slow, PayloadError):
        assert isinstance(fast, PayloadError) and (type(fast), str(fast)) == (type(slow), str(slow)), fast
        return False
    assert not isinstance(fast, PayloadError), f"the compiled path refused what Python takes: {fast}"
    assert_same(fast, slow)
    return False if encoding.name == "json" else _compiled(body, content_encoding, max_len, slow)


def _compiled(body: bytes, content_encoding: str | None, max_len: int, expected) -> bool:
    if content_encoding:
        body = zlib.decompress(body, 16 + zlib.MAX_WBITS if "gzip" in content_encoding else zlib.MAX_WBITS)
    got = fastpath.decode(body, max_len)
    if got is not None:
        assert_same(got, expected)
    return got is not None


# --- real senders' bodies ------------------------------------------------------------------------
@pytest.mark.parametrize("entry", MANIFEST, ids=[entry["file"] for entry in MANIFEST])
def test_real_senders_bodies_decode_the_same_on_both_decoders(entry):
    body = (SENDERS / entry["file"]).read_bytes()
    encoding = JSON_ENCODING if entry["content_type"] == JSON else PB_ENCODING
    coding = entry["content_encoding"] or None
    columns = parse(body, encoding, coding, BODY_LIMIT, MAX, fast=False)
    assert columns.spans > 0 and columns.rejected == 0, columns.problems
    for max_len in (MAX, 16):  # as sent, and with values cut to a short limit
        took = agree(body, encoding, coding, max_len)
        if encoding is PB_ENCODING and max_len == MAX:
            assert took, f"{entry['sender']}'s body was left to the Python path"
    if encoding is JSON_ENCODING:  # what the JSON sender sent, as protobuf: the compiled decoder takes it
        payload = decode(body, encoding).SerializeToString()
        assert agree(payload, PB_ENCODING)
        assert agree(gzip.compress(payload, mtime=0), PB_ENCODING, "gzip")


def test_the_corpus_holds_every_sender():
    senders = Counter(entry["sender"] for entry in MANIFEST)
    assert set(senders) >= {"sdk-protobuf", "sdk-json", "engine", "gateway"}, senders
    kinds = {(entry["sender"], name) for entry in MANIFEST for name in _span_names(entry)}
    assert {("engine", c.SPAN_REQUEST), ("engine", c.SPAN_CACHE_LOOKUP), ("gateway", c.SPAN_REQUEST)} <= kinds


def _span_names(entry) -> set[str]:
    body = (SENDERS / entry["file"]).read_bytes()
    request = decode(body, JSON_ENCODING if entry["content_type"] == JSON else PB_ENCODING)
    return {span.name for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans}


# --- generated bodies ------------------------------------------------------------------------------
_NAMES = [c.SPAN_REQUEST, c.SPAN_QUEUE, c.SPAN_LOAD_WAIT, c.SPAN_CACHE_LOOKUP, c.SPAN_PREFILL, c.SPAN_PREFILL_CHUNK,
          c.SPAN_DECODE, c.SPAN_CACHE_INSERT, c.SPAN_ENGINE_STEPS, c.SPAN_HEARTBEAT, c.SPAN_MODEL_LOAD,
          c.SPAN_LOAD_WEIGHTS, c.SPAN_LIFECYCLE, c.SPAN_ROUTE, "llm_request", "foreign", ""]
_KEYS = [c.REQUEST_ID, c.SESSION_ID, c.ENDPOINT, c.STREAMED, c.HTTP_STATUS, c.MAX_TOKENS, c.INPUT_TOKENS,
         c.OUTPUT_TOKENS, c.CACHED_TOKENS, c.FINISH_REASONS, c.QUEUE_MS, c.PREFILL_MS, c.DECODE_MS, c.TTFT_MS,
         c.CACHE_BLOCK_HASHES, c.CACHE_PROMPT_TOKENS, c.CACHE_MATCH, c.SEGMENT_ROLES, c.SEGMENT_STARTS,
         c.SEGMENT_ENDS, c.DECODE_STEP_OFFSETS, c.STEPS_START_OFFSETS, c.STEPS_DURATIONS, c.STEPS_MEMBERS,
         c.STEPS_REQUESTS, c.STEPS_PREFILL_SEQS, c.ENTRY_FINGERPRINT, c.ENTRY_TOKENS, c.QUEUE_DEPTH, c.CACHE_ENTRIES,
         c.LOAD_ID, c.ROUTE_CANDIDATES, c.ROUTE_SCORES, c.CHUNK_OFFSET, c.CHUNK_TOKENS, "gen_ai.usage.prompt_tokens",
         "foreign", "", "k\u00e9y \u2603"]
_RESOURCE_KEYS = [c.SERVICE_NAME, c.SERVICE_INSTANCE_ID, c.ENGINE, c.ENGINE_VERSION, c.MODEL, c.HOST_NAME,
                  c.OBSERVER, "foreign"]
_TIMES = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1]),
                   st.integers(1_700_000_000_000_000_000, 1_700_000_100_000_000_000))
_TEXT = st.one_of(st.text(max_size=12), st.sampled_from(["", "stop", "system", "user", "NaN", "Infinity",
                                                         "quote\" back\\slash", "\x00\x1f", "\U0001d11e"]))
_SCALAR = st.one_of(
    st.booleans(), st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, 1, -1, 2**62, 2**31]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.5, 1e16, 1e300, -0.0, 2.0, 1e-7]), _TEXT,
    st.none())
_VALUE = st.one_of(_SCALAR, st.lists(_SCALAR, max_size=6), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=12),
                   st.lists(st.integers(0, 100_000), max_size=12), st.lists(_TEXT, max_size=4),
                   st.tuples(st.just("kvlist"), st.text(max_size=3)),
                   st.tuples(st.just("bytes"), st.binary(max_size=4)),
                   st.lists(st.lists(st.integers(0, 5), max_size=2), min_size=1, max_size=2))
_INTS, _FLOATS = st.integers(0, 10**6), st.floats(0, 1e6)
_OFFSETS = st.lists(st.integers(0, 10**6), max_size=8)
#: Each contract key with a value of its own type: what a well-behaved sender writes.
_TYPED = {
    c.REQUEST_ID: _TEXT, c.SESSION_ID: _TEXT, c.ENDPOINT: _TEXT, c.CACHE_MATCH: _TEXT, c.LOAD_ID: _TEXT,
    c.STREAMED: st.booleans(), c.HTTP_STATUS: _INTS, c.MAX_TOKENS: _INTS, c.INPUT_TOKENS: _INTS,
    c.OUTPUT_TOKENS: _INTS, c.CACHED_TOKENS: _INTS, c.CACHE_PROMPT_TOKENS: _INTS, c.QUEUE_DEPTH: _INTS,
    c.CACHE_ENTRIES: _INTS, c.CHUNK_OFFSET: _INTS, c.CHUNK_TOKENS: _INTS, c.ENTRY_TOKENS: _INTS,
    c.ENTRY_FINGERPRINT: st.integers(-(2**63), 2**63 - 1), c.QUEUE_MS: _FLOATS, c.PREFILL_MS: _FLOATS,
    c.DECODE_MS: _FLOATS, c.TTFT_MS: _FLOATS, c.ROUTE_SCORES: st.lists(_FLOATS, max_size=4),
    c.CACHE_BLOCK_HASHES: st.lists(st.integers(-(2**63), 2**63 - 1), max_size=12), c.SEGMENT_STARTS: _OFFSETS,
    c.SEGMENT_ENDS: _OFFSETS, c.DECODE_STEP_OFFSETS: _OFFSETS, c.STEPS_START_OFFSETS: _OFFSETS,
    c.STEPS_DURATIONS: _OFFSETS, c.STEPS_MEMBERS: st.lists(st.integers(0, 2), max_size=6),
    c.STEPS_PREFILL_SEQS: _OFFSETS, c.FINISH_REASONS: st.lists(_TEXT, min_size=1, max_size=3),
    c.SEGMENT_ROLES: st.lists(_TEXT, max_size=3), c.STEPS_REQUESTS: st.lists(_TEXT, min_size=3, max_size=3),
    c.ROUTE_CANDIDATES: st.lists(_TEXT, max_size=3), "foreign": _SCALAR,
    "k\u00e9y \u2603": st.lists(_SCALAR, max_size=3),
}
_TYPED_ATTRIBUTES = st.lists(st.sampled_from(sorted(_TYPED)), max_size=10, unique=True).flatmap(
    lambda keys: st.tuples(*(st.tuples(st.just(key), _TYPED[key]) for key in keys)).map(list))
_ATTRIBUTES = st.lists(st.tuples(st.one_of(st.sampled_from(_KEYS), st.text(max_size=6)), _VALUE), max_size=8)


def _set(any_value, value) -> None:
    """``value`` as an OTLP AnyValue (None: empty; ("kvlist", k), ("bytes", b): those kinds)."""
    if isinstance(value, tuple) and value[0] == "kvlist":
        any_value.kvlist_value.values.add(key=value[1]).value.string_value = "v"
    elif isinstance(value, tuple):
        any_value.bytes_value = value[1]
    elif isinstance(value, bool):
        any_value.bool_value = value
    elif isinstance(value, int):
        any_value.int_value = value
    elif isinstance(value, float):
        any_value.double_value = value
    elif isinstance(value, str):
        any_value.string_value = value
    elif isinstance(value, list):
        any_value.array_value.SetInParent()
        for item in value:
            _set(any_value.array_value.values.add(), item)
    else:
        any_value.SetInParent()


def _add(holder, attributes) -> None:
    for key, value in attributes:
        _set(holder.attributes.add(key=key).value, value)


_ID16 = st.one_of(st.binary(min_size=16, max_size=16), st.just(bytes(16)), st.binary(max_size=17))
_ID8 = st.one_of(st.binary(min_size=8, max_size=8), st.just(bytes(8)), st.binary(max_size=9))


@st.composite
def requests(draw) -> ExportTraceServiceRequest:
    """An ExportTraceServiceRequest of 1-2 resources of contract and foreign spans: half of them as a
    well-behaved sender writes them (valid ids and times, each contract value of its type), half with
    mistyped and extreme values, bad ids and times among them."""
    request, clean = ExportTraceServiceRequest(), draw(st.booleans())
    for _ in range(draw(st.integers(1, 2))):
        resource_spans = request.resource_spans.add()
        _add(resource_spans.resource, draw(st.lists(st.tuples(st.sampled_from(_RESOURCE_KEYS), _TEXT if clean else
                                                              st.one_of(_TEXT, _VALUE)),
                                                    max_size=5, unique_by=lambda kv: kv[0])))
        for _ in range(draw(st.integers(1, 2))):
            scope_spans = resource_spans.scope_spans.add()
            scope_spans.scope.name, scope_spans.scope.version = draw(_TEXT), draw(_TEXT)
            for _ in range(draw(st.integers(0, 4))):
                _span(draw, scope_spans.spans.add(), clean)
    return request


def _span(draw, span, clean: bool) -> None:
    span.trace_id = draw(st.binary(min_size=16, max_size=16) if clean else _ID16)
    span.span_id = draw(st.binary(min_size=8, max_size=8) if clean else _ID8)
    span.parent_span_id = draw(st.one_of(st.just(b""), st.binary(min_size=8, max_size=8) if clean else _ID8))
    span.name = draw(st.sampled_from(_NAMES[:-2]) if clean else st.one_of(st.sampled_from(_NAMES), _TEXT))
    span.kind = draw(st.integers(0, 6))
    span.start_time_unix_nano = start = draw(st.integers(1_700_000_000_000_000_000, 1_700_000_100_000_000_000)
                                             if clean else _TIMES)
    span.end_time_unix_nano = draw(st.integers(start, start + 10**10) if clean else st.one_of(
        st.just(start), _TIMES, st.integers(start, min(start + 10**10, 2**64 - 1))))
    if clean:
        _add(span, draw(_TYPED_ATTRIBUTES))
    else:
        keys = draw(st.lists(st.tuples(st.sampled_from(_KEYS), _VALUE), max_size=10, unique_by=lambda kv: kv[0]))
        _add(span, keys + draw(_ATTRIBUTES) if draw(st.integers(0, 9)) == 0 else keys)  # rarely a key twice
    for _ in range(draw(st.integers(0, 2))):
        event = span.events.add(name=draw(st.one_of(st.sampled_from(
            [c.EVENT_CACHE_EVICT, c.EVENT_READY, c.EVENT_STARTED, c.EVENT_FIRST_RESPONSE, "other"]), _TEXT)),
            time_unix_nano=draw(st.integers(start, start + 10**9) if clean else st.one_of(st.just(start), _TIMES)))
        _add(event, draw(_TYPED_ATTRIBUTES if clean else _ATTRIBUTES))
    if draw(st.integers(0, 4)) == 0:
        link = span.links.add(trace_id=draw(_ID16), span_id=draw(_ID8), trace_state=draw(_TEXT))
        _add(link, draw(_TYPED_ATTRIBUTES if clean else _ATTRIBUTES))
    if draw(st.integers(0, 4)) == 0:
        span.status.code, span.status.message = draw(st.integers(0, 3)), draw(_TEXT)
        span.trace_state = draw(_TEXT)
        span.dropped_attributes_count = draw(st.integers(0, 2**32 - 1))


_LIMITS = st.sampled_from([MAX, MAX, MAX, 64, 8, 0])


def test_generated_protobuf_bodies_decode_the_same_on_both_decoders():
    taken = Counter()

    @bounded()
    @given(requests(), _LIMITS)
    def run(request, max_len):
        body = request.SerializeToString()
        taken[agree(body, PB_ENCODING, None, max_len)] += 1

    run()
    assert taken[True] >= 20 and taken[False] >= 20, taken  # both paths exercised, not one always


REGRESSIONS = Path(__file__).parent / "fixtures" / "fuzz-regressions"


@pytest.mark.parametrize("path", sorted(p.name for p in REGRESSIONS.iterdir() if p.name.startswith("crash-")))
def test_bodies_the_fuzzer_found_are_refused_or_decoded_by_both(path):
    """Each input the sanitized fuzzer stopped on (tests/fuzz), replayed on every run: the compiled
    decoder once took a tag written in 10 bytes (a padded varint) that protobuf refuses; a route's
    scores holding a NaN (both decoders keep it) once failed the oracle itself, whose comparison
    found no NaN equal to another."""
    agree((REGRESSIONS / path).read_bytes(), PB_ENCODING)


@pytest.mark.parametrize("length", range(1, 11))
def test_a_tag_is_refused_by_both_when_written_in_more_than_five_bytes(length):
    """upb reads a tag as a 32-bit varint: 5 bytes at most, however small its value."""
    tag = bytes([0xa9] + [0x80] * (length - 2) + [0x00]) if length > 1 else bytes([0x29])  # field 5, fixed64
    body = tag + b"metry..s"
    refused = length > 5
    with pytest.raises(DecodeError) if refused else contextlib.nullcontext():
        ExportTraceServiceRequest.FromString(body)
    agree(body, PB_ENCODING)


def test_generated_bytes_around_real_bodies_decode_the_same_or_are_refused_by_both():
    """Truncations, flipped bytes and splices of the real senders' protobuf bodies."""
    bodies = [(SENDERS / entry["file"]).read_bytes() for entry in MANIFEST if entry["content_type"] == PROTOBUF]

    @bounded()
    @given(st.sampled_from(bodies), st.data())
    def run(body, data):
        at = data.draw(st.integers(0, len(body)))
        how = data.draw(st.sampled_from(["cut", "flip", "insert", "twice"]))
        if how == "cut":
            body = body[:at]
        elif how == "flip" and at < len(body):
            body = body[:at] + bytes([body[at] ^ data.draw(st.integers(1, 255))]) + body[at + 1:]
        elif how == "insert":
            body = body[:at] + data.draw(st.binary(min_size=1, max_size=12)) + body[at:]
        else:
            body = body + body
        agree(body, PB_ENCODING, None, data.draw(_LIMITS))

    run()


def _otlp_json(request: ExportTraceServiceRequest) -> dict:
    """OTLP JSON of a request: protobuf's JSON mapping, ids as hex (otlp.py reads them back)."""
    from google.protobuf import json_format

    document = json_format.MessageToDict(request)
    for rs, rs_message in zip(document.get("resourceSpans", []), request.resource_spans, strict=False):
        for ss, ss_message in zip(rs.get("scopeSpans", []), rs_message.scope_spans, strict=False):
            for span, message in zip(ss.get("spans", []), ss_message.spans, strict=False):
                for key, field in (("traceId", "trace_id"), ("spanId", "span_id"), ("parentSpanId", "parent_span_id")):
                    if key in span:
                        span[key] = getattr(message, field).hex()
                for link, link_message in zip(span.get("links", []), message.links, strict=False):
                    link["traceId"], link["spanId"] = link_message.trace_id.hex(), link_message.span_id.hex()
    return document


def test_generated_json_bodies_decode_the_same_on_both_decoders():
    outcomes = Counter()

    @bounded(0.5)
    @given(requests(), _LIMITS)
    def run(request, max_len):
        body = json.dumps(_otlp_json(request)).encode()
        message = decode(body, JSON_ENCODING)  # (only Python reads JSON: parse's two paths are one here)
        assert _otlp_json(message) == _otlp_json(request)  # OTLP JSON carries all protobuf does (NaN as "NaN")
        outcomes[agree(message.SerializeToString(), PB_ENCODING, None, max_len)] += 1

    run()
    assert outcomes[True] >= 10, outcomes


_JSON_ANY = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=6),
              st.sampled_from(["\ud800", "\udc00x", "a\udbff"]), st.sampled_from([1e999, -1e999])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(
        st.one_of(st.text(max_size=6), st.sampled_from(["\ud800", "kind", "code", "intValue", "doubleValue",
                                                        "startTimeUnixNano", "traceId", "spans", "value"])),
        inner, max_size=3)), max_leaves=8)


def _places(document, path=()):
    """Every (container, key) of a JSON document where a value may be put."""
    if isinstance(document, dict):
        yield document, None
        for key, value in document.items():
            yield document, key
            yield from _places(value, (*path, key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            yield document, index
            yield from _places(value, (*path, index))


def test_generated_json_with_any_value_anywhere_is_a_message_or_a_400():
    """Any JSON value (non-finite numbers written bare, lone surrogate escapes, 2^70, keys
    protobuf knows) put anywhere in an OTLP JSON body: the receiver gets a message or a
    PayloadError, never another exception (which the receiver would answer 500)."""

    @bounded(0.5)
    @given(requests(), st.data())
    def run(request, data):
        document = _otlp_json(request)
        places = list(_places(document))
        for _ in range(data.draw(st.integers(1, 3))):
            container, key = data.draw(st.sampled_from(places))
            value = data.draw(_JSON_ANY)
            if isinstance(container, dict):
                container[data.draw(st.one_of(st.just(key), st.sampled_from(["\ud800", "kind", "x"])))
                          if key is not None else "\udc01"] = value
            else:
                container[key] = value
        body = json.dumps(document).encode()  # ensure_ascii: a lone surrogate as its escape; NaN bare
        agree(body, JSON_ENCODING)  # Columns or a PayloadError; anything else fails here

    run()


def test_the_reference_is_the_normalizer():
    """``agree``'s slow side is ``normalize``: a decoded real body equals ``reference`` as well."""
    entry = next(entry for entry in MANIFEST if entry["sender"] == "engine")
    body = (SENDERS / entry["file"]).read_bytes()
    assert_same(parse(body, PB_ENCODING, None, BODY_LIMIT, MAX, fast=False), reference(body))
