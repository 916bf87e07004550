"""Item 6 of issue 13: an upstream that reports itself (a tokentrace engine) behind the gateway.
The engine's row and the gateway's (the client's view) are one request: the store's queries merge
them (fragments/request_rows.sql); the gateway adds its hop (gateway.route); each row says who
observed it."""

from __future__ import annotations

import httpx
import pytest
from harness_collector import CollectorProcess
from harness_engine import EngineProcess, tiny_model  # noqa: F401 - fixture
from harness_gateway import GatewayProcess

from tokentrace.collector.stores.store_duckdb import DuckDBStore

pytestmark = pytest.mark.slow


def test_a_tokentrace_engine_behind_the_gateway_is_counted_once_and_joined_with_the_hop(
        tmp_path, tiny_model):  # noqa: F811
    collector = CollectorProcess(tmp_path).start()
    engine = EngineProcess(tmp_path, tiny_model, collector=collector, instance_id="engine-a").start()
    gateway = GatewayProcess(tmp_path, {"engine-a": engine.url}, "--tokenizer", str(tiny_model),
                             collector=collector).start()
    try:
        assert gateway.health()["upstreams"][0]["kind"] == "tokentrace"
        messages = [{"role": "system", "content": "Be brief. " * 30}, {"role": "user", "content": "hi"}]
        for i, stream in enumerate((True, False, True)):
            assert gateway.chat(messages, f"hop-{i}", session="s", stream=stream)["status"] == 200
        # Issue 47: GET /v1/models/{id} as the engine behind it answers it (404 before), and 404
        # model_not_found for a model nobody serves.
        served = httpx.get(engine.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        one = httpx.get(f"{gateway.url}/v1/models/{served}", timeout=10)
        assert one.status_code == 200 and one.json() == {"id": served, "object": "model", "created": 0,
                                                         "owned_by": "engine-a"}, one.text
        missing = httpx.get(f"{gateway.url}/v1/models/org/not-served", timeout=10)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found", missing.text
    finally:
        gateway.stop()
        engine.stop()
        collector.stop()
    # Issue 47: transformers' "PyTorch was not found. Models won't be available" at the gateway's start
    # (it only tokenizes) is not printed.
    assert "PyTorch was not found" not in gateway.log_path.read_text()
    rows = collector.sql("SELECT request_id, observer, instance_id, engine FROM requests ORDER BY request_id, observer")
    # Two views of each request: the engine's (inside) and the gateway's (outside, the client's).
    assert rows == [row for i in range(3) for row in ((f"hop-{i}", "engine", "engine-a", "mlx-lm"),
                                                       (f"hop-{i}", "gateway", "engine-a", "mlx-lm"))]
    hops = collector.sql("SELECT r.request_id, r.instance_id, r.policy FROM routes r ORDER BY r.request_id")
    assert hops == [(f"hop-{i}", "engine-a", "round_robin") for i in range(3)]
    gateway_spans = collector.sql("SELECT DISTINCT name FROM spans WHERE service_name = 'tokentrace-gateway' "
                                  "ORDER BY name")
    assert gateway_spans == [("gateway.route",), ("llm.request",)], \
        "the gateway adds its own view and hop, not the phases the engine reports"
    # One request each on every surface that reads the store: the merged row is the engine's, with the
    # gateway's bounds.
    raw = {(rid, observer): (start, end, prefill) for rid, observer, start, end, prefill in collector.sql(
        "SELECT request_id, observer, start_ns, end_ns, prefill_ms FROM requests")}
    store = DuckDBStore(collector.db)
    try:
        merged = store.requests(limit=10)
    finally:
        store.close()
    assert merged["request_id"].to_list() == ["hop-0", "hop-1", "hop-2"]
    assert merged["observer"].to_list() == ["engine"] * 3
    for row in merged.iter_rows(named=True):
        engine_row, gateway_row = raw[(row["request_id"], "engine")], raw[(row["request_id"], "gateway")]
        assert (row["start_ns"], row["end_ns"]) == (min(engine_row[0], gateway_row[0]),
                                                    max(engine_row[1], gateway_row[1]))
        assert row["prefill_ms"] == engine_row[2] is not None
