"""An edited message with nothing shared after it (issue 44): a one-shot request behind a system
prompt edited in its middle, or with a new timestamp at its very start (nothing before the change
shared: found by the segment's tail hash), is a ``prefix_change`` at the system message, built for
real on ``tokentrace engine``; a one-shot request that differs from an earlier one only in its last
message (a new question behind the same system prompt, even one that opens with the same words)
stays a clean hit."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
from harness_collector import CollectorProcess

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima",
         "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey"]


def text(seed: int, count: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 11) % len(WORDS)] for i in range(count))


def chat(engine, rid: str, messages: list[dict]) -> None:
    response = httpx.post(engine.url + "/v1/chat/completions", headers={"X-Request-Id": rid}, timeout=60,
                          json={"messages": messages, "max_tokens": 2, "ignore_eos": True})
    assert response.status_code == 200, response.text


def verdict(collector: CollectorProcess, rid: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "tokentrace", "analyze", "cache", "--request-id", rid, "--json",
                          "--url", collector.url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_an_edited_system_prompt_is_a_prefix_change_and_a_new_last_question_is_not(tmp_path, tiny_model,
                                                                                   engine_factory):
    collector = CollectorProcess(tmp_path).start()
    try:
        engine = engine_factory(collector=collector).start()
        system = f"{text(1, 60)} policy v1 {text(2, 60)}"
        chat(engine, "ed-1", [{"role": "system", "content": system}, {"role": "user", "content": text(3, 12)}])
        edited = system.replace("policy v1", "policy v2")
        chat(engine, "ed-2", [{"role": "system", "content": edited}, {"role": "user", "content": text(4, 12)}])
        # A timestamp at the very start of the system prompt: no block of the prompt is shared.
        for rid, clock, seed in (("ts-1", "[09:15:02]", 8), ("ts-2", "[11:42:57]", 9)):
            stamped_system = {"role": "system", "content": f"{clock} {system}"}
            chat(engine, rid, [stamped_system, {"role": "user", "content": text(seed, 12)}])
        # The same system prompt, and a question that opens with the same 40 words as q-1's.
        opening = text(5, 40)
        for rid, seed in (("q-1", 6), ("q-2", 7)):
            question = {"role": "user", "content": f"{opening} {text(seed, 9)}"}
            chat(engine, rid, [{"role": "system", "content": system}, question])
        engine.stop()

        edited_verdict = verdict(collector, "ed-2")
        assert (edited_verdict["result"], edited_verdict["cause"]) == ("partial", "prefix_change"), edited_verdict
        divergence = edited_verdict["divergence"]
        assert (divergence["segment_role"], divergence["segment_index"]) == ("system", 0)
        evidence = next(e for e in edited_verdict["evidence"] if e["kind"] == "divergence")
        assert evidence["earlier_request_id"] == "ed-1"
        # The change is inside the system message, after its shared opening.
        assert 0 < divergence["token_index"] <= edited_verdict["cached_tokens"]

        stamped = verdict(collector, "ts-2")
        assert stamped["cause"] == "prefix_change" and stamped["result"] in ("miss", "partial"), stamped
        assert stamped["cached_tokens"] < 16  # the chat template's opening at most
        assert (stamped["divergence"]["segment_role"], stamped["divergence"]["segment_index"]) == ("system", 0)
        evidence = next(e for e in stamped["evidence"] if e["kind"] == "divergence")
        assert evidence["earlier_request_id"] == "ts-1"

        question = verdict(collector, "q-2")
        assert (question["result"], question["cause"]) == ("hit", None), question
        assert question["cached_tokens"] > 0
    finally:
        collector.stop()
