"""Bad input gets its status and a precise message; everything sent before and after is stored."""

from __future__ import annotations

import gzip
import json
import os

import httpx
import pytest
from google.protobuf import json_format
from google.rpc import status_pb2
from harness_collector import CollectorProcess
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

PB = "application/x-protobuf"
JSON = "application/json"
BODY_LIMIT = 200_000


def make_request(count: int = 2, name: str = "good", **overrides) -> ExportTraceServiceRequest:
    """A valid request of ``count`` spans with fresh ids; ``overrides`` patch the first span."""
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add().spans
    for _ in range(count):
        span = spans.add(trace_id=os.urandom(16), span_id=os.urandom(8), name=name,
                         start_time_unix_nano=1_700_000_000_000_000_000,
                         end_time_unix_nano=1_700_000_000_100_000_000)
        span.attributes.add(key="k").value.string_value = "v"
    for key, value in overrides.items():
        setattr(spans[0], key, value)
    return request


def _huge_attribute() -> bytes:
    request = make_request(1, name="huge")
    request.resource_spans[0].scope_spans[0].spans[0].attributes.add(key="blob").value.string_value = "x" * 150_000
    return request.SerializeToString()


def _bad_utf8_protobuf() -> bytes:
    raw = make_request(1, name="UTF8MARK").SerializeToString()
    return raw.replace(b"UTF8MARK", b"UTF8\xff\xfeRK")


def _mixed_ids() -> bytes:
    request = make_request(3, name="mixed")
    request.resource_spans[0].scope_spans[0].spans[1].trace_id = b"short"
    return request.SerializeToString()


def _deep_kvlist(levels: int) -> bytes:
    """OTLP JSON whose one attribute is a kvlist ``levels`` deep (the trial's RecursionError)."""
    value = '{"kvlistValue":{"values":[{"key":"k","value":' * levels + '{"stringValue":"x"}' + "}]}}" * levels
    return ('{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"' + "ab" * 16 + '","spanId":"' + "cd" * 8
            + '","name":"deep","attributes":[{"key":"k","value":' + value + "}]}]}]}]}").encode()


# (caption, body, content type, extra headers, status, message fragment, spans stored from it)
CASES = [
    ("truncated protobuf", make_request(3).SerializeToString()[:-7], PB, {}, 400, "not a valid OTLP", 0),
    ("invalid JSON", b'{"resourceSpans": [', JSON, {}, 400, "not valid JSON: Expecting value", 0),
    ("JSON array, not an object", b"[1, 2]", JSON, {}, 400, "must be an object, received list", 0),
    ("JSON of the wrong shape", b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": {"x": 1}}]}]}]}', JSON,
     {}, 400, "not an OTLP ExportTraceServiceRequest", 0),
    ("wrong content type", b"hello", "text/plain", {}, 415, "received 'text/plain'", 0),
    ("missing content type", b"hello", "", {}, 415, "received 'none'", 0),
    ("gzip that is not gzip", b"definitely not gzip", PB, {"Content-Encoding": "gzip"}, 400, "is not gzip data", 0),
    ("unknown content encoding", make_request().SerializeToString(), PB, {"Content-Encoding": "br"}, 415,
     "Content-Encoding must be gzip, deflate or identity, received 'br'", 0),
    ("body over the limit", b"\x00" * (BODY_LIMIT + 1), PB, {}, 413, f"over the limit of {BODY_LIMIT} bytes", 0),
    ("gzip bomb", gzip.compress(b"\x00" * 5_000_000), PB, {"Content-Encoding": "gzip"}, 413,
     "decompressed body is over the limit", 0),
    ("trace id of the wrong length", make_request(1, trace_id=b"12345").SerializeToString(), PB, {}, 400,
     "trace_id must be 16 bytes, received 5", 0),
    ("one span of three with a bad trace id", _mixed_ids(), PB, {}, 200, "trace_id must be 16 bytes, received 5", 2),
    ("span id of the wrong length", make_request(1, span_id=b"123").SerializeToString(), PB, {}, 400,
     "span_id must be 8 bytes, received 3", 0),
    ("JSON trace id that is not hex", json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [
        {"traceId": "zz" * 16, "spanId": "00" * 8, "name": "x"}]}]}]}).encode(), JSON, {}, 400, "must be hex", 0),
    ("end before start", make_request(1, end_time_unix_nano=5).SerializeToString(), PB, {}, 400,
     "end_time_unix_nano is before start_time_unix_nano", 0),
    ("huge attribute value", _huge_attribute(), PB, {}, 200, "1 attribute values were truncated", 1),
    ("invalid UTF-8 in a protobuf string", _bad_utf8_protobuf(), PB, {}, 400, "UTF-8", 0),
    ("JSON nested 3,000 arrays deep", b'{"resourceSpans": ' + b"[" * 3000 + b"]" * 3000 + b"}", JSON, {}, 400,
     "nested too deeply", 0),
    ("kvlist 260 levels deep", _deep_kvlist(260), JSON, {}, 400, "nested too deeply", 0),
    ("kvlist 40 levels deep (over protobuf's 100 messages)", _deep_kvlist(40), JSON, {}, 400,
     "not an OTLP ExportTraceServiceRequest", 0),
    ("invalid UTF-8 in a JSON body", b'{"resourceSpans": [], "x": "\xff"}', JSON, {}, 400,
     "JSON body is not valid UTF-8 at byte", 0),
]


@pytest.fixture(scope="module")
def ledger():
    """Spans that must be stored at the end: {'sent': count}."""
    return {"stored": 0}


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    process = CollectorProcess(tmp_path_factory.mktemp("errors"), "--max-body-bytes", str(BODY_LIMIT),
                               "--max-attribute-length", "65536")
    process.start()
    yield process
    process.stop()


def _message(response) -> str:
    if response.status_code == 200:
        if response.headers["content-type"].startswith(PB):
            return ExportTraceServiceResponse.FromString(response.content).partial_success.error_message
        return json.loads(response.text).get("partialSuccess", {}).get("errorMessage", "")
    if response.headers["content-type"].startswith(PB):
        return status_pb2.Status.FromString(response.content).message
    return json_format.Parse(response.text, status_pb2.Status()).message


def _send_good(collector, ledger) -> None:
    response = collector.post(make_request(2).SerializeToString(), PB)
    assert response.status_code == 200
    ledger["stored"] += 2


@pytest.mark.parametrize(("caption", "body", "content_type", "headers", "status", "fragment", "stored"), CASES,
                         ids=[case[0] for case in CASES])
def test_bad_input_gets_its_status_and_message(collector, ledger, caption, body, content_type, headers, status,
                                               fragment, stored):
    _send_good(collector, ledger)
    response = collector.post(body, content_type, **headers)
    assert response.status_code == status, response.text
    assert fragment in _message(response)
    ledger["stored"] += stored
    _send_good(collector, ledger)


def test_other_methods_on_the_receivers_path_get_the_apis_405(collector, ledger):
    """Only POST goes straight to the receiver (collector/receiver/app.py, ReceiverFirst): GET and PUT of
    /v1/traces still reach the app's route and get its 405 envelope, and store nothing."""
    _send_good(collector, ledger)
    for method in ("GET", "PUT"):
        response = httpx.request(method, collector.url + "/v1/traces", content=make_request(2).SerializeToString(),
                                 headers={"Content-Type": PB}, timeout=30)
        assert response.status_code == 405, (method, response.text)
        assert response.json()["error"]["code"] == "method_not_allowed"
    _send_good(collector, ledger)


def test_everything_accepted_around_the_bad_input_is_stored_and_rejects_are_counted(collector, ledger):
    health = collector.health()
    assert health["status"] == "ok"
    assert health["accepted_spans"] == ledger["stored"]
    rejected = health["rejected"]
    assert rejected["malformed"] >= 6 and rejected["unsupported_media_type"] >= 3 and rejected["too_large"] >= 2
    assert rejected["invalid_span"] >= 4 and rejected["truncated_value"] >= 1
    assert collector.stop() == 0
    assert collector.sql("SELECT count(*) FROM spans") == [(ledger["stored"],)]
    [(length,)] = collector.sql("SELECT length(json_extract_string(attributes, '$.blob')) FROM spans "
                                "WHERE name = 'huge'")
    assert length == 65536
