"""The gateway as a first-class observer (issue 44, item 3), built for real: a real collector, a real
``tokentrace engine`` (which reports itself) and a real ``mlx_lm.server`` (which does not) on the tiny
generated model, behind the real ``tokentrace gateway``.

- A request that waited at the gateway (``--max-concurrency 1``) is ``queueing``: its end-to-end is
  the client's, its queue holds the gateway's wait, the request in flight is its blocker.
- One request is one row on every surface: requests the engine refused through the gateway are
  counted once by ``analyze report`` and by ``tokentrace_requests_total``.
- The upstream's own id of an answer (mlx_lm.server's ``chatcmpl-...``) finds the request.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import httpx
import pytest
from harness_collector import CollectorProcess, wait_for
from harness_engine import EngineProcess, tiny_model  # noqa: F401 - fixture
from harness_gateway import GatewayProcess, MlxLmServer, verdict
from harness_llama import llama_factory, tiny_gguf  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow

SYSTEM = {"role": "system", "content": "You answer in one short sentence. " * 6}


def _cli(collector: CollectorProcess, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokentrace", "analyze", *args, "--url", collector.url],
                          capture_output=True, text=True, timeout=120)


def _report(collector: CollectorProcess) -> dict:
    out = _cli(collector, "report", "--since", "all", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _requests_total(collector: CollectorProcess, outcome: str) -> float:
    text = httpx.get(collector.url + "/metrics", headers=collector.headers, timeout=30).text
    pattern = re.compile(r'^tokentrace_requests_total\{([^}]*)\} (\S+)$', re.M)
    return sum(float(value) for labels, value in pattern.findall(text) if f'outcome="{outcome}"' in labels)


@pytest.fixture
def behind_gateway(tmp_path, tiny_model):  # noqa: F811
    collector = CollectorProcess(tmp_path).start()
    engine = EngineProcess(tmp_path, tiny_model, collector=collector, instance_id="engine-a").start()
    gateway = GatewayProcess(tmp_path, {"engine-a": engine.url}, "--max-concurrency", "1",
                             collector=collector).start()
    yield collector, engine, gateway
    gateway.stop()
    engine.stop()
    collector.stop()


def test_a_request_that_waited_at_the_gateway_is_queueing_with_the_clients_end_to_end(behind_gateway):
    collector, _, gateway = behind_gateway
    assert gateway.health()["upstreams"][0]["kind"] == "tokentrace"
    long_messages = [SYSTEM, {"role": "user", "content": "Tell a long story."}]
    seen: dict = {}
    holder = threading.Thread(target=lambda: seen.update(gateway.chat(
        long_messages, "holder", max_tokens=400, ignore_eos=True)))
    holder.start()
    # The short request arrives while the long one holds the upstream's only slot.
    wait_for(lambda: gateway.health()["upstreams"][0]["inflight"] == 1, 30, "the long request in flight")
    short = gateway.chat([SYSTEM, {"role": "user", "content": "Hi."}], "waiter", max_tokens=3, ignore_eos=True)
    holder.join(120)
    assert short["status"] == 200 and seen["status"] == 200
    answer = verdict(collector, "waiter")
    slow = answer["slow"]
    breakdown = slow["breakdown_ms"]
    # Waiting at the gateway is most of what the client saw, and the verdict says so.
    assert slow["category"] == "queueing", slow
    assert breakdown["queue"] > 0.5 * short["e2e_ms"], (breakdown, short["e2e_ms"])
    # The request's end-to-end is the client's (arrival at the gateway -> last byte), not the engine's.
    assert abs(breakdown["e2e"] - short["e2e_ms"]) < 0.1 * short["e2e_ms"] + 50, (breakdown, short["e2e_ms"])
    blockers = [e for e in slow["evidence"] if e["kind"] == "blocker"]
    assert [b["request_id"] for b in blockers] == ["holder"], slow["evidence"]
    out = _cli(collector, "slow", "--request-id", "waiter")
    assert out.returncode == 0, out.stderr
    assert "queueing" in out.stdout and "holder" in out.stdout, out.stdout
    # One row per request in the report, whose gateway wait is the one the verdict saw.
    report = _report(collector)
    assert report["requests"] == 2 and report["outcomes"] == {"completed": 2}, report


def test_a_request_refused_behind_the_gateway_is_counted_once_on_every_surface(behind_gateway):
    collector, _, gateway = behind_gateway
    for i in range(4):
        refused = gateway.chat([SYSTEM, {"role": "user", "content": "Hi."}], f"refused-{i}", max_tokens=0)
        assert refused["status"] == 400
    assert gateway.chat([SYSTEM, {"role": "user", "content": "Hi."}], "served", max_tokens=2)["status"] == 200
    report = wait_for(lambda: (r := _report(collector))["requests"] >= 5 and r, 30, "5 requests reported")
    # Two observers (the gateway and the engine) reported each: still one request each.
    assert report["outcomes"] == {"rejected": 4, "completed": 1}, report
    assert wait_for(lambda: _requests_total(collector, "completed") == 1, 30, "/metrics counted the request")
    assert _requests_total(collector, "rejected") == 4
    answer = verdict(collector, "refused-0")
    assert answer["slow"]["outcome"] == "rejected"


def test_the_upstreams_own_id_of_an_answer_finds_the_request(tmp_path, tiny_model):  # noqa: F811
    collector = CollectorProcess(tmp_path).start()
    server = MlxLmServer(tmp_path, tiny_model).start()
    gateway = GatewayProcess(tmp_path, {"mini-1": server.url}, "--tokenizer", str(tiny_model),
                             collector=collector).start()
    try:
        answer = gateway.chat([SYSTEM, {"role": "user", "content": "Hi."}], "ours-1", stream=False, max_tokens=3)
        assert answer["status"] == 200
        alias = answer["body"]["id"]
        assert alias != "ours-1"
        verdict(collector, "ours-1")
        out = _cli(collector, "slow", "--request-id", alias, "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["request_id"] == "ours-1"
        out = _cli(collector, "cache", "--request-id", alias, "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["request_id"] == "ours-1"
        api = httpx.get(f"{collector.url}/api/requests/{alias}/verdict", headers=collector.headers, timeout=30)
        assert api.status_code == 200 and api.json()["slow"]["request_id"] == "ours-1"
        page = httpx.get(f"{collector.url}/requests/{alias}", headers=collector.headers, timeout=30)
        assert page.status_code == 200 and "ours-1" in page.text
    finally:
        gateway.stop()
        server.stop()
        collector.stop()


def test_llama_cpps_own_id_of_an_answer_finds_the_request(tmp_path, tiny_gguf, llama_factory):  # noqa: F811
    collector = CollectorProcess(tmp_path).start()
    server = llama_factory(tiny_gguf / "model.gguf")
    gateway = GatewayProcess(tmp_path, {"l1": server.url}, collector=collector).start()
    try:
        streamed = gateway.chat([SYSTEM, {"role": "user", "content": "Hi."}], "ours-l", max_tokens=3)
        assert streamed["status"] == 200
        alias = streamed["events"][0]["id"]
        assert alias.startswith("chatcmpl-"), alias
        verdict(collector, "ours-l")
        out = _cli(collector, "slow", "--request-id", alias, "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["request_id"] == "ours-l"
    finally:
        gateway.stop()
        collector.stop()
