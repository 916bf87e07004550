"""One request, several observers, in the store (docs/analyzers.md): the engine's row and the
gateway's row of one request are one row in every named query over requests, on DuckDB and on
ClickHouse (chdb) alike; the upstream's own id of an answer finds the request."""

from __future__ import annotations

import json

import pytest
from harness_store import BACKENDS, store_url

from tokentrace import contract as c
from tokentrace.collector import stores
from tokentrace.collector.receiver.ingest import Counters, Pipeline
from tokentrace.collector.receiver.otlp import JSON, Encoding

T0 = 1_790_000_000_000_000_000
MS = 1_000_000


def _value(value):
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    return {"stringValue": value}


def _span(trace: str, span: str, start: int, end: int, attrs: dict, name: str = c.SPAN_REQUEST) -> dict:
    return {"traceId": trace * 32, "spanId": span * 16, "name": name, "kind": 2,
            "startTimeUnixNano": str(start), "endTimeUnixNano": str(end),
            "attributes": [{"key": k, "value": _value(v)} for k, v in attrs.items()]}


def _resource(observer: str, spans: list[dict]) -> dict:
    attrs = {c.SERVICE_NAME: f"tokentrace-{observer}", c.SERVICE_INSTANCE_ID: "engine-a", c.ENGINE: "mlx-lm",
             c.OBSERVER: observer}
    return {"resource": {"attributes": [{"key": k, "value": _value(v)} for k, v in attrs.items()]},
            "scopeSpans": [{"scope": {"name": "test"}, "spans": spans}]}


def _body() -> bytes:
    """Three requests: "both" (the engine waited 5 ms, the gateway 300 ms before it: the client saw
    1,000 ms), "refused" (both saw a 400), "outside" (only the gateway saw it: its upstream reports
    nothing), and "earlier", a baseline request the engine alone saw."""
    common = {c.SESSION_ID: "s1", c.STREAMED: True, c.CLIENT_DISCONNECTED: False}
    engine = [
        _span("a", "1", T0 + 310 * MS, T0 + 990 * MS, {
            c.REQUEST_ID: "both", c.QUEUE_MS: 5.0, c.PREFILL_MS: 100.0, c.DECODE_MS: 500.0, c.TTFT_MS: 120.0,
            c.INPUT_TOKENS: 40, c.OUTPUT_TOKENS: 8, c.HTTP_STATUS: 200, c.FIRST_CONTENT_MS: 121.0, **common}),
        _span("b", "2", T0 + 2000 * MS, T0 + 2001 * MS, {
            c.REQUEST_ID: "refused", c.HTTP_STATUS: 400, c.ERROR_TYPE: "invalid_request_error", **common}),
        _span("d", "4", T0 - 60_000 * MS, T0 - 59_000 * MS, {
            c.REQUEST_ID: "earlier", c.QUEUE_MS: 1.0, c.PREFILL_MS: 100.0, c.DECODE_MS: 500.0, c.TTFT_MS: 110.0,
            c.INPUT_TOKENS: 40, c.OUTPUT_TOKENS: 8, c.HTTP_STATUS: 200, **common}),
    ]
    evidence = json.dumps({c.UPSTREAM_RESPONSE_ID: "chatcmpl-xyz"})
    gateway = [
        _span("e", "5", T0, T0 + 1000 * MS, {
            c.REQUEST_ID: "both", c.QUEUE_MS: 300.0, c.TTFT_MS: 440.0, c.FIRST_CONTENT_MS: 441.0,
            c.INPUT_TOKENS: 40, c.OUTPUT_TOKENS: 8, c.HTTP_STATUS: 200, c.UPSTREAM_EVIDENCE: evidence, **common}),
        _span("f", "6", T0 + 1999 * MS, T0 + 2002 * MS, {
            c.REQUEST_ID: "refused", c.QUEUE_MS: 0.0, c.HTTP_STATUS: 400, **common}),
        _span("c", "7", T0 + 3000 * MS, T0 + 3100 * MS, {
            c.REQUEST_ID: "outside", c.QUEUE_MS: 0.0, c.TTFT_MS: 50.0, c.HTTP_STATUS: 200, **common}),
    ]
    return json.dumps({"resourceSpans": [_resource(c.OBSERVER_ENGINE, engine),
                                         _resource(c.OBSERVER_GATEWAY, gateway)]}).encode()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, request):
    chdb_dir = request.getfixturevalue("chdb_dir")
    tmp = tmp_path_factory.mktemp("merge")
    batch = Pipeline(Counters(), 16 << 20, 65536).batch(_body(), Encoding("json", JSON))
    made = {}
    for backend in BACKENDS:
        made[backend] = stores.open_store(store_url(backend, tmp, chdb_dir))
        assert made[backend].write(batch)
    yield made
    for store in made.values():
        store.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_observers_of_a_request_are_one_row_with_the_clients_bounds(loaded, backend):
    store = loaded[backend]
    both = store.request("both")
    assert both["observer"] == "engine"
    assert (both["start_ns"], both["end_ns"]) == (T0, T0 + 1000 * MS)  # the client's end-to-end
    assert both["queue_ms"] == pytest.approx(305.0)  # the engine's queue plus the gateway's wait
    assert both["ttft_ms"] == pytest.approx(430.0)  # the engine's, from the gateway's arrival
    assert both["first_content_ms"] == pytest.approx(441.0)  # the client's
    assert both["prefill_ms"] == 100.0
    rows = store.requests(since_ns=T0, until_ns=T0 + 10_000 * MS)
    assert rows["request_id"].to_list() == ["both", "refused", "outside"]
    assert rows["observer"].to_list() == ["engine", "engine", "gateway"]
    report = store.bulk("requests_report", since_ns=T0, until_ns=T0 + 10_000 * MS, instance_id=None, limit=100,
                        model=None, session_id=None, request_prefix=None)
    assert report["request_id"].to_list() == ["both", "refused", "outside"]
    assert report["http_status"].to_list() == [200, 400, 200]
    session = store.rows("session_requests", session_id="s1")
    assert [r["request_id"] for r in session] == ["earlier", "both", "refused", "outside"]
    base = store.rows("baseline", instance_id="engine-a", request_id="outside", since_ns=T0 - 3_600_000 * MS,
                      before_ns=T0 + 3000 * MS, limit=200)
    assert [r["request_id"] for r in base] == ["both", "earlier"]
    assert base[0]["queue_ms"] == pytest.approx(305.0)
    turn = store.rows("previous_turn", session_id="s1", before_ns=T0 + 1999 * MS, request_id="refused")
    assert [r["request_id"] for r in turn] == ["both"]
    holders = store.rows("slot_holders", instance_id="engine-a", request_id="outside", t0_ns=T0,
                         t1_ns=T0 + 3000 * MS)
    assert [r["request_id"] for r in holders] == ["both", "refused"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_upstreams_own_id_finds_the_request(loaded, backend):
    store = loaded[backend]
    assert store.request("chatcmpl-xyz")["request_id"] == "both"
    assert store.request("chatcmpl-xy") is None
    assert store.request("nothing") is None
