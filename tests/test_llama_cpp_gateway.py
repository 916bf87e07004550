"""llama.cpp for real: the gateway in front of real ``llama-server`` processes on the tiny model's GGUF,
a real collector. Each verdict carries llama.cpp's own numbers, checked against the ``timings`` each
response returned (the gateway passes the body through unchanged).

Servers run with one slot (``-np 1``) and no host-memory prompt cache (``--cache-ram 0``), so a
slot's KV cache is the only thing a request can reuse: what ``cache_n`` says is what the slot held.
"""

from __future__ import annotations

import httpx
import pytest
from harness_collector import CollectorProcess
from harness_gateway import GatewayProcess, verdict
from harness_llama import llama_factory, tiny_gguf  # noqa: F401

pytestmark = pytest.mark.slow

SERVER_ARGS = ("-np", "1", "--cache-ram", "0", "-c", "2048")


@pytest.fixture
def collector(tmp_path):
    process = CollectorProcess(tmp_path).start()
    yield process
    process.stop()


@pytest.fixture
def gateway(tmp_path, collector):
    made: list[GatewayProcess] = []

    def make(upstreams: dict[str, str], *args: str) -> GatewayProcess:
        process = GatewayProcess(tmp_path, upstreams, *args, collector=collector).start()
        made.append(process)
        return process

    yield make
    for process in made:
        process.stop()


def system(tag: str) -> dict:
    return {"role": "system", "content": f"You are the {tag} assistant. Answer briefly and kindly. " * 6}


def conversation(tag: str) -> list[list[dict]]:
    first = [system(tag), {"role": "user", "content": "Tell me about the harbour at dawn."}]
    second = [*first, {"role": "assistant", "content": "Boats leave as the light comes up."},
              {"role": "user", "content": "And what do the fishermen bring back?"}]
    return [first, second]


def _chat(gw: GatewayProcess, messages: list[dict], rid: str, session: str) -> dict:
    answer = gw.chat(messages, rid, session=session, stream=False, max_tokens=4)
    assert answer["status"] == 200, answer["body"]
    return answer["body"]["timings"] | {"id_slot": answer["body"].get("id_slot")}


def _tokens(url: str, messages: list[dict]) -> list[int]:
    """llama-server's own token ids for the chat prompt of ``messages``."""
    import httpx

    with httpx.Client(base_url=url, timeout=30) as client:
        prompt = client.post("/apply-template", json={"messages": messages}).json()["prompt"]
        return client.post("/tokenize", json={"content": prompt, "parse_special": True}).json()["tokens"]


def _check_numbers(collector: CollectorProcess, rid: str, timings: dict) -> dict:
    """The verdicts of ``rid``, after checking they carry llama.cpp's numbers for it."""
    both = verdict(collector, rid)
    cache, slow = both["cache"], both["slow"]
    assert cache["cached_tokens"] == timings["cache_n"]
    assert cache["prompt_tokens"] == timings["cache_n"] + timings["prompt_n"]
    assert slow["tokens"]["cached"] == timings["cache_n"]
    assert slow["breakdown_ms"]["prefill"] == pytest.approx(timings["prompt_ms"], abs=1e-3)
    for found in (cache, slow):
        (reported,) = [e for e in found["evidence"] if e["kind"] == "engine_reported"]
        assert reported["basis"] == "measured" and reported["engine"] == "llama.cpp"
        assert {k.rsplit(".", 1)[1]: v for k, v in reported["facts"].items() if ".timings." in k} == {
            key: timings[key] for key in ("cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms")}
    return cache


def test_a_slots_cached_prefix_is_reused(tiny_gguf, llama_factory, gateway, collector):  # noqa: F811
    server = llama_factory(tiny_gguf / "model.gguf", *SERVER_ARGS)
    gw = gateway({"l1": server.url}, "--route", "session")
    first, second = (_chat(gw, m, f"reuse-{i}", "reuse") for i, m in enumerate(conversation("reuse")))
    gw.stop()
    assert first["cache_n"] == 0 and second["cache_n"] > 0
    cache = _check_numbers(collector, "reuse-1", second)
    assert cache["result"] in ("hit", "partial") and cache["cause"] in (None, "new_prefix")
    # The slot held turn 1's prompt and its answer; turn 2 extends the prompt, so llama.cpp reused
    # at least turn 1's prompt (its own /tokenize length).
    assert second["cache_n"] >= first["prompt_n"] - 1


def test_a_changed_system_prompt_is_a_prefix_change_at_message_0(tiny_gguf, llama_factory, gateway,  # noqa: F811
                                                                  collector):
    server = llama_factory(tiny_gguf / "model.gguf", *SERVER_ARGS)
    gw = gateway({"l1": server.url}, "--route", "session")
    original = conversation("original")[0]
    edited = [system("edited"), original[1]]
    _chat(gw, original, "sys-0", "sys")
    timings = _chat(gw, edited, "sys-1", "sys")
    gw.stop()
    cache = _check_numbers(collector, "sys-1", timings)
    assert cache["cause"] == "prefix_change" and cache["result"] in ("miss", "partial")
    assert cache["divergence"]["segment_index"] == 0 and cache["divergence"]["segment_role"] == "system"
    # llama.cpp reused exactly the tokens the two prompts share: the template's opening and "You are
    # the", up to the edited word.
    before, after = (_tokens(server.url, m) for m in (original, edited))
    shared = next(i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b)
    assert timings["cache_n"] == shared and shared < len(_tokens(server.url, [original[0]]))


def test_a_conversation_moved_to_a_second_llama_server_is_an_instance_change(tiny_gguf, llama_factory,  # noqa: F811
                                                                             gateway, collector):
    a = llama_factory(tiny_gguf / "model.gguf", *SERVER_ARGS)
    b = llama_factory(tiny_gguf / "model.gguf", *SERVER_ARGS)
    gw = gateway({"lc-a": a.url, "lc-b": b.url}, "--route", "round_robin")
    first, second = (_chat(gw, m, f"move-{i}", "move") for i, m in enumerate(conversation("moved")))
    gw.stop()
    before = verdict(collector, "move-0")["cache"]
    cache = _check_numbers(collector, "move-1", second)
    assert cache["instance_id"] != before["instance_id"]
    assert cache["cause"] == "instance_change" and cache["cached_on"] == before["instance_id"]
    assert second["cache_n"] == 0 and first["prompt_n"] > 0


def test_a_small_context_that_forces_re_processing_gets_the_reason(tiny_gguf, llama_factory, gateway,  # noqa: F811
                                                                   collector):
    # 256 tokens of context and context shift on: the first request's generation runs past the end of
    # the context, llama.cpp shifts the slot (discarding from the start, n_keep = 0), and the next
    # turn's prompt no longer matches what the slot holds: llama.cpp re-processes all of it.
    server = llama_factory(tiny_gguf / "model.gguf", "-np", "1", "--cache-ram", "0", "-c", "256",
                           "--context-shift")
    gw = gateway({"small": server.url}, "--route", "session")
    first = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story."}]
    second = [*first, {"role": "assistant", "content": "Once upon a time."}, {"role": "user", "content": "More."}]
    answer = gw.chat(first, "small-0", session="small", stream=False, max_tokens=240, ignore_eos=True)
    assert answer["status"] == 200, answer["body"]
    held = answer["body"]["timings"]
    assert held["prompt_n"] + held["predicted_n"] > 256, "the first answer must outgrow the context"
    timings = _chat(gw, second, "small-1", "small")
    gw.stop()
    assert timings["cache_n"] < 8, "llama.cpp re-processed the prompt"
    cache = _check_numbers(collector, "small-1", timings)
    assert cache["result"] == "miss"
    reasons = [e for e in cache["evidence"] if e["kind"] == "engine_reason"]
    assert len(reasons) == 1, cache["evidence"]
    (reason,) = reasons
    assert reason["basis"] == "inferred" and reason["source"] == "llama.cpp.reprocess_reason"
    assert reason["text"].startswith(f"The slot's context was full ({held['prompt_n'] + held['predicted_n']} of 256")


def test_a_request_whose_unknown_part_cannot_be_the_largest_gets_its_category(tiny_gguf, llama_factory,  # noqa: F811
                                                                               gateway, collector):
    # Issue 44: llama.cpp reports prefill and decode, not a load wait, so every request behind the
    # gateway was `undecomposed` ("load_wait not measured by this observer. Its largest part cannot
    # be named"). The load wait is at most what prefill, decode and queue leave of the e2e.
    import subprocess
    import sys

    server = llama_factory(tiny_gguf / "model.gguf", *SERVER_ARGS)
    gw = gateway({"l1": server.url}, "--route", "session")
    answer = gw.chat(conversation("long")[0], "long-0", session="long", stream=False, max_tokens=200,
                     ignore_eos=True)
    assert answer["status"] == 200, answer["body"]
    timings = answer["body"]["timings"]
    gw.stop()
    slow = verdict(collector, "long-0")["slow"]
    parts = slow["breakdown_ms"]
    assert parts["decode"] == pytest.approx(timings["predicted_ms"], abs=1e-3) and parts["load_wait"] is None
    assert slow["category"] == "decode", slow["evidence"]
    (bounded,) = [e for e in slow["evidence"] if e["kind"] == "bounded"]
    left = parts["e2e"] - parts["queue"] - parts["prefill"] - parts["decode"]
    assert bounded["unmeasured"] == ["load_wait"]
    assert bounded["at_most_ms"]["load_wait"] == pytest.approx(left, abs=2e-3)
    assert bounded["at_most_ms"]["load_wait"] < parts["decode"]
    assert not [e for e in slow["evidence"] if e["kind"] == "undecomposed"]
    assert slow["evidence"][0]["kind"] == "tpot"  # explained as decode
    cli = subprocess.run([sys.executable, "-m", "tokentrace", "analyze", "slow", "--request-id", "long-0",
                          "--url", collector.url], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert "category: decode" in cli.stdout and "load_wait not measured by this observer (at most" in cli.stdout
    assert "None" not in cli.stdout
    page = httpx.get(f"{collector.url}/requests/long-0.json", timeout=30).json()
    assert page["slow"]["category"] == "decode"
    report = httpx.get(f"{collector.url}/api/report?since=all", timeout=60).json()
    assert report["categories"] == {"decode": 1}, report["categories"]
