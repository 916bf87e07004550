"""The llama.cpp adapter's reading of llama-server's documents (shapes from llama.cpp's
tools/server/server-common.cpp ``server_slot_stats::to_json`` and server-context.cpp
``server_slot::to_json``); the same adapter runs against real servers in test_llama_cpp_gateway.py."""

from __future__ import annotations

import json

from tokentrace.engine_shim.gateway.adapters.base import CHAT, Facts, Probe
from tokentrace.engine_shim.gateway.adapters.llama_cpp import LlamaCppAdapter, parse_slots

SLOTS = [{"id": 0, "n_ctx": 256, "speculative": False, "is_processing": False, "id_task": 7,
          "n_prompt_tokens": 95, "n_prompt_tokens_processed": 95, "n_prompt_tokens_cache": 0,
          "next_token": [{"has_next_token": False, "has_new_line": False, "n_remain": 0, "n_decoded": 200}]},
         {"id": 1, "n_ctx": 256, "speculative": False, "is_processing": True}]


def _answer(cache_n: int, prompt_n: int, predicted_n: int = 4) -> dict:
    return {"id": "chatcmpl-1", "choices": [{"index": 0, "finish_reason": "length"}], "id_slot": 0,
            "usage": {"prompt_tokens": cache_n + prompt_n, "completion_tokens": predicted_n},
            "timings": {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": 12.5, "prompt_per_token_ms": 0.1,
                        "predicted_n": predicted_n, "predicted_ms": 8.25}}


def _facts(adapter: LlamaCppAdapter, payload: dict) -> Facts:
    facts = Facts()
    adapter.facts_from_payload(facts, payload, CHAT)
    adapter.finish(facts)
    return facts


def test_slots_are_read_with_their_context_and_last_task():
    slots = parse_slots(SLOTS)
    assert (slots[0].n_ctx, slots[0].prompt_tokens, slots[0].decoded, slots[0].processing) == (256, 95, 200, False)
    assert (slots[1].prompt_tokens, slots[1].processing) == (None, True)
    assert parse_slots({"error": "not enabled"}) == {}


def test_timings_give_exact_cached_tokens_prefill_decode_and_the_slot():
    adapter = LlamaCppAdapter("l1", "http://127.0.0.1:1", None, Probe(kind="llama.cpp", details={"n_ctx": 256}))
    facts = _facts(adapter, _answer(cache_n=40, prompt_n=12))
    assert (facts.cached_tokens, facts.prompt_tokens, facts.completion_tokens) == (40, 52, 4)
    assert (facts.prefill_ms, facts.decode_ms, facts.slot) == (12.5, 8.25, "0")
    assert facts.evidence["llama.cpp.timings.cache_n"] == 40 and facts.evidence["llama.cpp.slot.n_ctx"] == 256


def test_a_slot_that_outgrew_its_context_is_the_reason_for_re_processing():
    adapter = LlamaCppAdapter("l1", "http://127.0.0.1:1", None, Probe(kind="llama.cpp", details={"n_ctx": 256}))
    first = _facts(adapter, _answer(cache_n=0, prompt_n=95, predicted_n=200))
    assert "llama.cpp.reprocess_reason" not in first.evidence  # nothing was cached before
    second = _facts(adapter, _answer(cache_n=1, prompt_n=119))
    assert second.evidence["llama.cpp.reprocess_reason"] == (
        "the slot's context was full (295 of 256 tokens after its previous request): llama.cpp discarded the "
        "cached sequence and re-processed the prompt")
    third = _facts(adapter, _answer(cache_n=119, prompt_n=10))
    assert "llama.cpp.reprocess_reason" not in third.evidence  # 123 of 256: the slot had room


def test_verdicts_cite_the_engine_numbers_as_measured_and_the_adapter_reasons_as_inferred():
    from tokentrace.analyzers.upstream import upstream_evidence

    row = {"engine": "ollama", "upstream_evidence": json.dumps({
        "ollama.load_duration_ns": 2101234567, "ollama.model": "gemma3:1b",
        "ollama.cold_start": "model gemma3:1b was unloaded when its keep-alive expired at 2026-03-01T10:05:00+00:00"})}
    reported, reason = upstream_evidence(row, "slow")
    assert (reported.kind, reported.basis, reported.data["facts"]) == (
        "engine_reported", "measured", {"ollama.load_duration_ns": 2101234567})
    assert (reason.kind, reason.basis) == ("engine_reason", "inferred")
    assert reason.text.startswith("Model gemma3:1b was unloaded when its keep-alive expired at 2026-03-01T10:05")
    assert [e.kind for e in upstream_evidence(row, "cache")] == ["engine_reported"]
    assert upstream_evidence({"engine": "vllm", "upstream_evidence": None}, "slow") == []
