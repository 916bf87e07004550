"""The gateway in front of engines nobody here wrote: two (three) real ``mlx_lm.server`` processes on
the generated tiny model, a real collector, the real ``tokentrace gateway`` (docs/gateway.md).

The upstreams stay up for the module; each test uses its own system prompt so that what one test
left in an upstream's prompt cache never explains another's verdict.
"""

from __future__ import annotations

import statistics
import subprocess
import sys

import httpx
import pytest
from harness_collector import CollectorProcess, wait_for
from harness_engine import tiny_model  # noqa: F401 - fixture
from harness_gateway import GatewayProcess, MlxLmServer, verdict

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("gateway")


@pytest.fixture(scope="module")
def collector(workdir):
    process = CollectorProcess(workdir).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def upstreams(workdir, tiny_model):  # noqa: F811
    servers = {name: MlxLmServer(workdir, tiny_model) for name in ("mini-1", "mini-2")}
    for server in servers.values():
        server.start()
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture
def gateway(workdir, tiny_model, collector, upstreams):  # noqa: F811
    made: list[GatewayProcess] = []

    def make(*args: str, upstream_urls: dict[str, str] | None = None) -> GatewayProcess:
        urls = upstream_urls or {name: server.url for name, server in upstreams.items()}
        process = GatewayProcess(workdir, urls, "--tokenizer", str(tiny_model), *args, collector=collector)
        made.append(process.start())
        return process

    yield make
    for process in made:
        process.stop()


def system(tag: str) -> dict:
    return {"role": "system", "content": f"You are the {tag} assistant. Answer briefly and kindly. " * 12}


def turns(tag: str) -> list[list[dict]]:
    """Three growing turns of one conversation (assistant answers fixed, so runs are comparable)."""
    first = [system(tag), {"role": "user", "content": "Tell me about the harbour at dawn."}]
    second = [*first, {"role": "assistant", "content": "Boats leave as the light comes up."},
              {"role": "user", "content": "And what do the fishermen bring back?"}]
    third = [*second, {"role": "assistant", "content": "Mostly mackerel and some crabs."},
             {"role": "user", "content": "Which of those sells best?"}]
    return [first, second, third]


def report(collector: CollectorProcess) -> dict:
    out = subprocess.run([sys.executable, "-m", "tokentrace", "analyze", "report", "--url", collector.url,
                          "--since", "all", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    return json.loads(out.stdout)


def test_round_robin_moves_the_conversation_and_the_verdict_names_the_other_upstream(gateway, collector):
    gw = gateway("--route", "round_robin")
    seen = [gw.chat(messages, f"rr-{i}", session="rr") for i, messages in enumerate(turns("round-robin"))]
    assert [a["status"] for a in seen] == [200, 200, 200], [a.get("text") for a in seen]
    assert [answer["headers"]["x-request-id"] for answer in seen] == ["rr-0", "rr-1", "rr-2"]
    repeat = gw.chat(turns("round-robin")[1], "rr-repeat", session="rr")  # turn 2 again, on its upstream
    gw.stop()
    verdicts = [verdict(collector, f"rr-{i}")["cache"] for i in range(3)]
    assert verdicts[0]["instance_id"] != verdicts[1]["instance_id"], "round_robin alternates upstreams"
    assert verdicts[1]["cause"] == "instance_change"
    assert verdicts[1]["cached_on"] == verdicts[0]["instance_id"]
    moved = next(e for e in verdicts[1]["evidence"] if e["kind"] == "cached_elsewhere")
    assert moved["basis"] == "inferred" and moved["entry_request_id"] == "rr-0"
    assert verdicts[2]["cause"] == "instance_change" and verdicts[2]["cached_on"] == verdicts[1]["instance_id"]
    again = verdict(collector, "rr-repeat")["cache"]
    assert again["instance_id"] == verdicts[1]["instance_id"]
    reported = repeat["usage"]["prompt_tokens_details"]["cached_tokens"] if repeat["usage"] else None
    # The client did not ask for usage: the gateway asked for it, read it, and kept it from the client.
    assert reported is None
    assert again["result"] == "hit" and again["cause"] is None
    assert again["cached_tokens"] >= again["prompt_tokens"] - 1


def test_session_policy_keeps_the_conversation_and_the_report_compares_policies(gateway, collector):
    gw = gateway("--route", "session")
    for i, messages in enumerate(turns("sticky")):
        assert gw.chat(messages, f"st-{i}", session="sticky-1")["status"] == 200
    gw.stop()
    verdicts = [verdict(collector, f"st-{i}")["cache"] for i in range(3)]
    assert len({v["instance_id"] for v in verdicts}) == 1, "session policy never moves a conversation"
    assert [v["cause"] for v in verdicts[1:]] == [None, None]
    routing = {row["policy"]: row for row in report(collector)["routing"]}
    assert routing["session"]["avoidable_prefill_tokens"] == 0
    assert routing["session"]["decisions"] >= 3
    # The round-robin run of the previous test moved a conversation twice: its avoidable prefill is
    # the prompt tokens the previous upstream held (at least the 12x repeated system prompt).
    if "round_robin" in routing:
        assert routing["round_robin"]["avoidable_prefill_tokens"] > 100
        assert routing["round_robin"]["decisions_with_avoidable"] >= 2


def test_an_edited_earlier_message_is_a_prefix_change_naming_that_message(gateway, collector):
    gw = gateway("--route", "session")
    original = turns("editor")[1]
    edited = [dict(m) for m in original]
    edited[1]["content"] = "Tell me about the harbour at dusk."
    assert gw.chat(original, "ed-0", session="editor")["status"] == 200
    assert gw.chat(edited, "ed-1", session="editor")["status"] == 200
    gw.stop()
    cache = verdict(collector, "ed-1")["cache"]
    assert cache["cause"] == "prefix_change"
    assert cache["divergence"]["segment_index"] == 1 and cache["divergence"]["segment_role"] == "user"


def test_a_byte_limited_upstream_cache_gives_capacity_marked_inferred(workdir, tiny_model, gateway,  # noqa: F811
                                                                      collector):
    small = MlxLmServer(workdir, tiny_model, "--prompt-cache-bytes", "300000").start()
    try:
        gw = gateway("--route", "round_robin", upstream_urls={"small": small.url})
        first = [system("capacity"), {"role": "user", "content": "hi"}]
        other = [system("evicting"), {"role": "user", "content": "hi"}]
        answers = [gw.chat(first, "cap-0"), gw.chat(first, "cap-1"), gw.chat(other, "cap-2"),
                   gw.chat(first, "cap-3")]
        gw.stop()
    finally:
        small.stop()
    assert all(a["status"] == 200 for a in answers)
    assert verdict(collector, "cap-1")["cache"]["result"] == "hit"
    cache = verdict(collector, "cap-3")["cache"]
    assert cache["cause"] == "capacity", cache
    lost = next(e for e in cache["evidence"] if e["kind"] == "no_longer_cached")
    assert lost["basis"] == "inferred" and lost["entry_request_id"] in ("cap-0", "cap-1")
    # mlx_lm.server reports no cache size: the evidence says so, never "held None entries, None bytes".
    for rid in ("cap-1", "cap-3"):
        text = subprocess.run([sys.executable, "-m", "tokentrace", "analyze", "cache", "--request-id", rid, "--url",
                               collector.url], capture_output=True, text=True, timeout=120)
        assert text.returncode == 0 and "evidence:" in text.stdout, text.stderr
        assert "None" not in text.stdout, text.stdout
        assert "what the cache held is not reported" in text.stdout, text.stdout


def test_a_repeat_nobody_measured_is_unknown_not_a_capacity_miss(gateway, collector):
    """Issue 44: a lookup without matched tokens was read as 0 reused, and the repeat of a prompt the
    upstream had just served became a capacity miss. Streamed without usage (the client's own
    stream_options), mlx_lm.server says nothing of its cache: the verdict is unknown, and says why."""
    gw = gateway("--route", "session")
    chat = [system("unmeasured"), {"role": "user", "content": "Name three colours of the sea."}]
    assert gw.chat(chat, "um-0", session="unmeasured")["status"] == 200
    quiet = gw.chat(chat, "um-1", session="unmeasured", stream_options={"include_usage": False})
    assert quiet["status"] == 200 and quiet["usage"] is None
    gw.stop()
    cache = verdict(collector, "um-1")["cache"]
    assert (cache["result"], cache["cause"], cache["cached_tokens"]) == ("unknown", "unknown", None), cache
    assert cache["prompt_tokens"] > 0 and cache["evidence"][0]["kind"] == "unavailable"
    text = subprocess.run([sys.executable, "-m", "tokentrace", "analyze", "cache", "--request-id", "um-1", "--url",
                           collector.url], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert "unknown · cause unknown" in text.stdout and "cached unknown" in text.stdout, text.stdout
    assert "None" not in text.stdout and "did not report cached tokens" in text.stdout, text.stdout


def test_ttft_and_e2e_agree_with_the_client_and_responses_pass_through(gateway, collector):
    gw = gateway("--route", "least_loaded")
    client = [gw.chat([system("timing"), {"role": "user", "content": f"count to {i}"}], f"tm-{i}", max_tokens=16)
              for i in range(8)]
    plain = gw.chat([system("timing"), {"role": "user", "content": "plain"}], "tm-plain", stream=False)
    anonymous = {"model": "default_model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    generated = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json=anonymous)
    asked = gw.chat([system("timing"), {"role": "user", "content": "usage please"}], "tm-usage",
                    stream_options={"include_usage": True})
    gw.stop()
    assert generated.status_code == 200 and generated.headers["x-request-id"].startswith("req-")
    assert plain["status"] == 200 and plain["body"]["system_fingerprint"], "engine fields pass through"
    assert asked["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0, "asked-for usage is delivered"
    rows = [verdict(collector, f"tm-{i}")["slow"]["breakdown_ms"] for i in range(8)]
    # Signed gaps, client minus gateway. The gateway reads the first token before relaying it, so its TTFT
    # can never exceed the client's; a busy machine (a full local run once saw gaps of 1.5-41 ms) only ever
    # delays what the client sees, so an error of the gateway's clocks, which is the same for every
    # request, shows in the smallest gap, while the median says only how busy the machine was.
    ttft = [c["ttft_ms"] - row["ttft"] for row, c in zip(rows, client, strict=True) if c["ttft_ms"]]
    e2e = [abs(c["e2e_ms"] - row["e2e"]) for row, c in zip(rows, client, strict=True)]
    assert len(ttft) >= 4
    assert min(ttft) >= -0.5, f"the gateway's TTFT ends after the client saw the token: {ttft}"
    assert min(ttft) <= 5.0 and statistics.median(ttft) <= 50.0, ttft
    assert min(e2e) <= 5.0 and statistics.median(e2e) <= 50.0, e2e
    plain_row = verdict(collector, "tm-plain")["slow"]["breakdown_ms"]
    assert plain_row["ttft"] is None, "a non-streamed answer has no first-token time"


def test_failover_when_an_upstream_is_killed_mid_run(workdir, tiny_model, gateway, collector, upstreams):  # noqa: F811
    doomed = MlxLmServer(workdir, tiny_model).start()
    try:
        gw = gateway("--route", "round_robin", upstream_urls={"mini-1": upstreams["mini-1"].url,
                                                               "doomed": doomed.url})
        before = [gw.chat([system("failover"), {"role": "user", "content": f"q{i}"}], f"fo-{i}") for i in range(2)]
    finally:
        doomed.kill()
    after = [gw.chat([system("failover"), {"role": "user", "content": f"q{i}"}], f"fo-{i}") for i in range(2, 6)]
    state = {u["name"]: u for u in wait_for(lambda: gw.health()["upstreams"], 10, "gateway health")}
    gw.stop()
    assert all(a["status"] == 200 for a in before + after), [a["status"] for a in after]
    assert state["doomed"]["down"] is True and state["mini-1"]["down"] is False
    instances = [verdict(collector, f"fo-{i}")["cache"]["instance_id"] for i in range(2, 6)]
    assert set(instances) == {"mini-1"}
    events = httpx.get(collector.url + "/instances.json", timeout=30).json()
    assert "doomed" in str(events)


def test_admission_api_key_and_per_client_rate_limit(gateway):
    gw = gateway("--api-key", "sesame", "--rate-limit", "0.5")
    body = {"model": "default_model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    refused = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    key = {"Authorization": "Bearer sesame"}
    first = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=key, timeout=60)
    second = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=key, timeout=60)
    assert first.status_code == 200
    assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1
    assert second.headers["x-request-id"] and second.json()["error"]["type"] == "rate_limited"
