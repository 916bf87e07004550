"""Issue 17: the compiled decoder (collector/decoding/fastpath.py) gives exactly the Columns of the Python
normalizer, or None (the Python path then decides). Differential (harness_fastpath.py): a decoded
payload must equal ``normalize(...).columns()`` in every table, origin, key and counter. Payloads
from software we did not write (the OpenTelemetry SDK encoding the golden traces, vLLM's native
spans) and from our own shims (the MLX engine's span builder, the gateway's observer) and generated
engine-shaped batches must take the C path: a decoder that always gave up would fail here. Hostile
input: test_fastpath_hostile.py."""

from __future__ import annotations

import gzip
import json
import random
import time

import golden
import numpy as np
import pyarrow as pa
import pytest
from harness_fastpath import (
    MAX,
    PB,
    assert_same,
    check,
    engine_request,
    gateway_payloads,
    json_fixture,
    mlx_payload,
    one_span,
    reference,
    set_attributes,
    span_of,
    span_suffix,
    taken,
    varint,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from test_collector_fuzz import SEED

from tokentrace import contract as c
from tokentrace.collector.decoding import fastpath
from tokentrace.collector.decoding.columns import Columns
from tokentrace.collector.decoding.normalize import normalize
from tokentrace.collector.receiver.ingest import parse
from tokentrace.collector.receiver.otlp import JSON, Encoding, decode


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
        for wire in (False, True):  # on the SDK, and as the engine's exporter process writes them
            got = taken(mlx_payload(seed, wire))
            assert {"requests", "segments", "cache_evictions", "instance_events", "load_stages",
                    "steps"} <= set(got.tables)
    tables = set()
    for body in gateway_payloads():
        tables |= set(taken(body).tables)
    assert {"routes", "requests", "instance_events"} <= tables


def test_vllm_native_spans_and_rare_values_are_left_to_python_and_the_rest_decoded():
    vllm = json_fixture("vllm_native_spans.json")
    assert fastpath.decode(vllm, MAX) is None and reference(vllm).count("requests")  # vLLM's translation
    handwritten = decode((golden.FIXTURES / "otlp_handwritten.json").read_bytes(), Encoding("json", JSON))
    assert fastpath.decode(handwritten.SerializeToString(), MAX) is None  # a kvlist and a bytes value
    for resource_spans in handwritten.resource_spans:
        for span in resource_spans.scope_spans[0].spans:
            kept = [kv for kv in span.attributes if kv.value.WhichOneof("value") not in ("kvlist_value", "bytes_value")]
            del span.attributes[:]
            span.attributes.extend(kept)
    got = taken(handwritten.SerializeToString())  # links, events, status, a foreign scope
    assert json.loads(got.tables["spans"].column("links")[0].as_py()) == [
        {"trace_id": "00000000000000000000000000000001", "span_id": "0000000000000002"}]


def test_generated_engine_batches_with_odd_values_take_the_fast_path():
    rng = random.Random(SEED)
    for _ in range(30):
        got = taken(engine_request(rng).SerializeToString())
        assert got.count("cache_lookups") and got.count("routes") and got.count("instance_events")
    batch = engine_request(rng, requests=300, odd=False).SerializeToString()  # a big one: thousands of spans
    assert taken(batch).spans >= 2400


@pytest.mark.parametrize(("declared", "stored"), [
    (1, 1), (0, 0), (2**63 - 1, 2**63 - 1), (True, None), (False, None), (-1, None), ("1", None), (1.0, None),
    (None, None),  # an empty AnyValue
], ids=repr)
def test_an_inserts_declared_limit_rank_is_stored_alike_by_both_decoders(declared, stored):
    """cache_inserts.limit_rank: a non-negative int_value is a rank (what the cache verdict counts the
    byte limit by); a bool, a double, a string or a negative one is NULL, the attribute kept as sent."""
    body = one_span(c.SPAN_CACHE_INSERT, {c.CACHE_MAX_BYTES: 1000, c.CACHE_LIMIT_RANK: declared}).SerializeToString()
    got = taken(body)  # the Python path's Columns, exactly
    assert got.tables["cache_inserts"].column("limit_rank").to_pylist() == [stored]
    attributes = json.loads(got.tables["spans"].column("attributes")[0].as_py())
    assert attributes[c.CACHE_LIMIT_RANK] == declared and type(attributes[c.CACHE_LIMIT_RANK]) is type(declared)
    absent = taken(one_span(c.SPAN_CACHE_INSERT, {c.CACHE_MAX_BYTES: 1000}).SerializeToString())
    assert absent.tables["cache_inserts"].column("limit_rank").to_pylist() == [None]


def _edit(change):
    """The body of ``one_span()`` after ``change(request)``."""
    request = one_span()
    change(request)
    return request.SerializeToString()


def _resource_twice() -> bytes:
    """A ResourceSpans whose resource field comes twice: protobuf merges the two."""
    resource_spans = one_span().resource_spans[0]
    again = type(resource_spans)(resource=resource_spans.resource).SerializeToString()
    part = resource_spans.SerializeToString() + again
    return b"\x0a" + varint(len(part)) + part


def _event_key_twice(request) -> None:
    event = span_of(request).events.add(name="e", time_unix_nano=10**18)
    for value in (1, 2):
        event.attributes.add(key="k").value.int_value = value


_LONG = "x" * 100
#: (caption, body, length limit): payloads the normalizer refuses, changes or counts, and rare
#: encodings, each left to the Python path.
LEFT_TO_PYTHON = [
    ("a span name longer than the limit", one_span(name="llm." + _LONG).SerializeToString(), 50),
    ("an attribute value longer than the limit", one_span(attributes={"k": _LONG}).SerializeToString(), 50),
    ("an array element longer than the limit", one_span(attributes={"k": ["a", _LONG]}).SerializeToString(), 50),
    ("a status message longer than the limit", _edit(lambda r: setattr(span_of(r).status, "message", _LONG)), 50),
    ("a resource value longer than the limit",
     _edit(lambda r: set_attributes(r.resource_spans[0].resource, {"k": _LONG})),
     50),
    ("a 5-byte trace id", one_span(trace_id=b"12345").SerializeToString(), MAX),
    ("a 3-byte parent span id", one_span(parent_span_id=b"123").SerializeToString(), MAX),
    ("an all-zero trace id", one_span(trace_id=bytes(16)).SerializeToString(), MAX),
    ("an all-zero span id", one_span(span_id=bytes(8)).SerializeToString(), MAX),
    ("an end before the start", one_span(end_time_unix_nano=1).SerializeToString(), MAX),
    ("an end beyond 2^63", one_span(end_time_unix_nano=2**63).SerializeToString(), MAX),
    ("an event beyond 2^63", _edit(lambda r: span_of(r).events.add(name="e", time_unix_nano=2**64 - 1)), MAX),
    ("an attribute key sent twice", _edit(lambda r: set_attributes(span_of(r), {c.REQUEST_ID: "again"})), MAX),
    ("an event attribute key sent twice", _edit(_event_key_twice), MAX),
    ("a kvlist value", _edit(lambda r: span_of(r).attributes.add(key="kv").value.kvlist_value.values.add(key="a")),
     MAX),
    ("a bytes value", _edit(lambda r: setattr(span_of(r).attributes.add(key="b").value, "bytes_value", b"\x01")),
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
    ("a span name sent twice", span_suffix(b"\x2a\x01x"), MAX),
    ("a status sent twice", span_suffix(b"\x7a\x00\x7a\x00"), MAX),
    ("a group field", span_suffix(b"\xa3\x01\xa4\x01"), MAX),
    ("kind sent as bytes", span_suffix(b"\x32\x01x"), MAX),
    ("a resource sent twice", _resource_twice(), MAX),
    ("invalid UTF-8 in a schema url the normalizer never reads",
     _edit(lambda r: setattr(r.resource_spans[0].scope_spans[0], "schema_url", "@@@")).replace(b"@@@", b"\xff\xfe@"),
     MAX),
    ("invalid UTF-8 in a scope attribute",
     _edit(lambda r: set_attributes(r.resource_spans[0].scope_spans[0].scope, {"k": "@@@"})).replace(
         b"@@@", b"\xed\xa0\x80"),
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
    reordered = b"".join(b"\x0a" + varint(len(part)) + part
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
            spans += b"\x12" + varint(len(part)) + part
        part = spans + type(scope_spans)(scope=scope_spans.scope).SerializeToString()
        scopes += b"\x12" + varint(len(part)) + part
    return scopes + type(resource_spans)(resource=resource_spans.resource).SerializeToString()


def test_the_length_limit_counts_code_points():
    text = "é☃𝄞" * 10  # 30 code points, 90 bytes of UTF-8
    body = one_span(attributes={"k": text, "a": ["x", text]}).SerializeToString()
    taken(body, 30)
    assert check(body, 29) is None
    assert check(body, 0) is None and check(body, -1) is None
    nameless = ExportTraceServiceRequest()
    nameless.resource_spans.add().scope_spans.add().spans.add(trace_id=bytes(15) + b"\x01", span_id=b"\x01" + bytes(7))
    nameless = nameless.SerializeToString()
    taken(nameless, 0)
    assert check(nameless, -1) is None  # Python counts even an empty name as cut below 0
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


def test_a_group_of_batches_counts_the_bytes_its_parts_counted():
    """The writer's group (Columns.concat) takes its byte count from its parts' counts, which the
    decoding threads made; it equals a count of the group's own buffers, and a part counted
    before it was changed is counted again."""
    rng = random.Random(SEED + 3)
    parts = [taken(engine_request(rng, requests=n, odd=False).SerializeToString()) for n in (3, 40, 1)]
    counted = [part.nbytes for part in parts]
    group = Columns.concat(parts)
    recount = sum(rows.get_total_buffer_size() for rows in group.tables.values())
    assert group.nbytes == sum(counted) == recount
    changed = parts[1].select(np.arange(parts[1].spans) % 2 == 0)  # a new set of tables, not counted yet
    group = Columns.concat([parts[0], changed])
    assert group.nbytes == sum(rows.get_total_buffer_size() for rows in group.tables.values()) < recount


def test_the_decoder_counts_the_bytes_pyarrow_counts():
    """The decoder gives the byte count of the tables it exports (Columns.nbytes, charged against
    the byte budget until the rows are merged): the count pyarrow makes of the imported buffers,
    for batches with nulls, lists, odd values, one span and thousands."""
    rng = random.Random(SEED + 4)
    bodies = [engine_request(rng).SerializeToString() for _ in range(30)]
    bodies += [one_span().SerializeToString(), engine_request(rng, requests=300, odd=True).SerializeToString()]
    for body in bodies:
        got = fastpath.decode(body, MAX)
        assert got is not None and got._nbytes is not None  # counted by the decoder, not recounted below
        assert got.nbytes == sum(rows.get_total_buffer_size() for rows in got.tables.values()) > 0


def test_threads_decoding_at_once_get_what_one_thread_gets():
    """The decoder holds no GIL while it walks a body (collector/receiver/ingest.py decodes on several threads
    of the collector's process): bodies decoded by twelve threads at once, each many times, equal
    the Python reference; floats are in every one of them. Twelve: more than the decoders the
    module keeps between calls (8), so that calls also make and free decoders of their own."""
    import concurrent.futures

    rng = random.Random(SEED + 1)
    bodies = [engine_request(rng, requests=40, odd=False).SerializeToString() for _ in range(12)]
    expected = [reference(body) for body in bodies]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        for _ in range(5):
            results = list(pool.map(lambda body: fastpath.decode(body, MAX), bodies * 3))
            for got, want in zip(results, expected * 3, strict=True):
                assert got is not None
                assert_same(got, want)


def test_batches_of_every_size_in_turn_on_one_decoder():
    """A decoder reserves what its last request's tables needed (table_hint_t): a huge batch after
    small ones, small ones after it and a batch without engine tables still give the reference's
    columns."""
    rng = random.Random(SEED + 2)
    bodies = [engine_request(rng, requests=2, odd=False), engine_request(rng, requests=300, odd=False),
              engine_request(rng, requests=1, odd=False), one_span(), engine_request(rng, requests=300, odd=True),
              engine_request(rng, requests=5, odd=True)]
    for body in (request.SerializeToString() for request in bodies):
        got = fastpath.decode(body, MAX)
        assert got is not None
        assert_same(got, reference(body))


def test_floats_are_written_as_pythons_repr_writes_them():
    """The decoder writes a float as float.__repr__ (json.dumps) does without asking Python
    (fastotlp_double.cpp): the same text for random bit patterns, measured milliseconds, every
    binary exponent and the decimal powers where repr switches to an exponent."""
    import math
    import struct

    from tokentrace.collector.decoding import _fastotlp

    rng = random.Random(SEED)
    values = [struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0] for _ in range(300_000)]
    values += [rng.randrange(10**9) / 1e6 for _ in range(100_000)]
    values += [rng.random() * 10.0 ** rng.randint(-30, 30) for _ in range(100_000)]
    values += [sign * math.ldexp(m, e) for e in range(-1074, 1024) for m in (1.0, 1.5, 1.0000000000000002)
               for sign in (1, -1)]
    values += [float(f"{d}e{k}") for k in range(-330, 310) for d in (1, 5, 9.999999999999999)]
    finite = [v for v in values if math.isfinite(v)]
    assert len(finite) > 500_000
    wrong = [(repr(v), _fastotlp.repr_double(v)) for v in finite if _fastotlp.repr_double(v) != repr(v)]
    assert not wrong, wrong[:5]


def _hashes_lookup(elements: list[bytes]) -> bytes:
    """A cache lookup span whose block hashes are the AnyValue ``elements``, as encoded here."""
    array = b"".join(b"\x0a" + varint(len(element)) + element for element in elements)
    value = b"\x2a" + varint(len(array)) + array
    key = c.CACHE_BLOCK_HASHES.encode()
    pair = b"\x0a" + varint(len(key)) + key + b"\x12" + varint(len(value)) + value
    lookup = one_span(c.SPAN_CACHE_LOOKUP, {c.CACHE_PROMPT_TOKENS: 40, c.CACHE_MATCH: c.MATCH_NONE})
    return span_suffix(b"\x4a" + varint(len(pair)) + pair, lookup)


@pytest.mark.parametrize("bits", [0, 1, 7, 8, 55, 56, 57, 62, 63, 64])
def test_int_elements_of_every_varint_length_decode_as_protobuf_reads_them(bits):
    """Block hashes are 9-10 byte varints, which the decoder reads as a word and two bytes: every
    length from 1 to 10 bytes, values at each length's edges, and the forms protobuf also accepts
    (padded with continuation bytes, a 10th byte with more than bit 63) give the Python path's
    columns; a varint that runs past its element, or ends inside it, is left to Python."""
    rng = random.Random(SEED + bits)
    values = {(1 << bits) - 1 if bits else 0, 1 << min(bits, 63), rng.getrandbits(64) | (1 << bits >> 1)}
    canonical = [b"\x18" + varint(value & (2**64 - 1)) for value in sorted(values)]
    decoded = taken(_hashes_lookup(canonical))
    stored = decoded.tables["prefix_blocks"].column("hashes").to_pylist()[0]
    assert [h & (2**64 - 1) for h in stored] == [v & (2**64 - 1) for v in sorted(values)]
    low7 = (1 << bits) - 1 & 0x7F
    padded = [bytes([0x80 | low7] + [0x80] * (n - 2) + [0]) for n in (9, 10)]  # the value in 9 and 10 bytes
    wide = bytes([0xFF] * 9 + [0x7F])  # a 10th byte with bits beyond the 64th
    for element in [b"\x18" + form for form in [*padded, wide]]:
        assert check(_hashes_lookup([element])) is not None
    for broken in (b"\x18" + b"\xff" * 9 + b"\x80\x01",  # 11 bytes
                   b"\x18" + b"\xff" * 9,  # runs past its element
                   b"\x18" + b"\x81" + b"\x80" * 6 + b"\x01\x05",  # ends a byte before its element does
                   b"\x18" + b"\x81" + b"\x80" * 7 + b"\x01\x05"):
        check(_hashes_lookup([broken, *canonical]))
