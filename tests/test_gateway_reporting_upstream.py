"""Item 6 of issue 13: an upstream that reports itself (a tokentrace engine) behind the gateway.
The engine's row is the request's row; the gateway adds only its hop (gateway.route), joined on the
request id; nobody counts a request twice; each row says who observed it."""

from __future__ import annotations

import pytest
from harness_collector import CollectorProcess
from harness_engine import EngineProcess, tiny_model  # noqa: F401 - fixture
from harness_gateway import GatewayProcess

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
    finally:
        gateway.stop()
        engine.stop()
        collector.stop()
    rows = collector.sql("SELECT request_id, observer, instance_id, engine FROM requests ORDER BY request_id")
    assert rows == [(f"hop-{i}", "engine", "engine-a", "mlx-lm") for i in range(3)]
    hops = collector.sql("SELECT r.request_id, r.instance_id, r.policy, q.observer FROM routes r "
                         "JOIN requests q USING (request_id) ORDER BY r.request_id")
    assert hops == [(f"hop-{i}", "engine-a", "round_robin", "engine") for i in range(3)]
    gateway_spans = collector.sql("SELECT count(*) FROM spans WHERE service_name = 'tokentrace-gateway' "
                                  "AND name <> 'gateway.route'")
    assert gateway_spans == [(0,)], "the gateway sends only its hop for an upstream that reports itself"
