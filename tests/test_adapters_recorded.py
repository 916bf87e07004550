"""The Ollama, Exo, SGLang and LM Studio adapters against recorded documents (none of these engines
installs here): each fixture cites the documentation or source its shapes follow, and a real local
HTTP server serves them so that the adapters' own HTTP code (probe, poll) runs."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime

import httpx
import pytest
from harness_recorded import RecordedEngine, load

from tokentrace.engine_shim.gateway.adapters import adapter_class, detect
from tokentrace.engine_shim.gateway.adapters.base import CHAT, Facts, Probe
from tokentrace.engine_shim.gateway.adapters.exo import cold_start_reason, parse_state
from tokentrace.engine_shim.gateway.adapters.ollama import API_CHAT, API_GENERATE


def run(coro):
    return asyncio.run(coro)


async def _with_client(engine: RecordedEngine, kind: str, action):
    async with httpx.AsyncClient(timeout=10) as client:
        found = await detect(client, engine.url)
        adapter = adapter_class(kind)("u1", engine.url, client, found or Probe(kind=kind))
        return found, await action(adapter)


def _facts(adapter, documents, route) -> Facts:
    facts = Facts()
    for document in documents:
        adapter.facts_from_payload(facts, document, route)
    adapter.finish(facts)
    return facts


# --- Ollama -----------------------------------------------------------------------------------------
@pytest.fixture
def ollama():
    docs = load("ollama")["documents"]
    with RecordedEngine({"GET /api/version": (200, docs["GET /api/version"]),
                         "GET /api/ps": (200, docs["GET /api/ps loaded"])}) as engine:
        yield engine, docs


def test_ollama_is_detected_and_a_load_after_keep_alive_expiry_is_named(ollama):
    engine, docs = ollama

    async def scenario(adapter):
        first = await adapter.poll()
        engine.serve("GET /api/ps", docs["GET /api/ps unloaded"])
        second = await adapter.poll()
        warm = _facts(adapter, [docs["POST /api/chat warm"]], API_CHAT)
        cold = _facts(adapter, [docs["POST /api/chat cold"]], API_CHAT)
        return first, second, warm, cold

    found, (first, second, warm, cold) = run(_with_client(engine, "ollama", scenario))
    assert found.kind == "ollama" and found.version == "0.13.0" and found.models == ("gemma3:1b",)
    assert first.models == ("gemma3:1b",) and second.models == ()
    (event,) = second.events
    assert event.name == "model.unloaded" and "keep-alive expired at 2026-03-01T10:05:00.123456+00:00" in event.detail
    # A warm request's few milliseconds of load_duration are not a cold start.
    assert warm.load_ms == pytest.approx(4.071084) and "ollama.cold_start" not in warm.evidence
    recorded = docs["POST /api/chat cold"]
    assert cold.load_ms == recorded["load_duration"] / 1e6
    assert cold.prefill_ms == recorded["prompt_eval_duration"] / 1e6
    assert cold.decode_ms == recorded["eval_duration"] / 1e6
    assert (cold.prompt_tokens, cold.completion_tokens, cold.finish_reasons) == (26, 12, ["stop"])
    assert cold.evidence["ollama.cold_start"].startswith(
        "model gemma3:1b was unloaded when its keep-alive expired at 2026-03-01T10:05:00.123456+00:00")
    assert cold.evidence["ollama.keep_alive_expired_at"] == "2026-03-01T10:05:00.123456+00:00"


def test_ollama_unload_before_expiry_is_not_called_a_keep_alive_expiry(ollama):
    engine, docs = ollama
    engine.serve("GET /api/ps", docs["GET /api/ps loaded, expiry ahead"])

    async def scenario(adapter):
        await adapter.poll()
        engine.serve("GET /api/ps", docs["GET /api/ps unloaded"])
        await adapter.poll()
        return _facts(adapter, [docs["POST /api/chat cold"]], API_CHAT)

    _, cold = run(_with_client(engine, "ollama", scenario))
    assert "before its keep-alive expired" in cold.evidence["ollama.cold_start"]


def test_ollama_streamed_generate_takes_its_numbers_from_the_final_document(ollama):
    engine, docs = ollama
    streamed = docs["POST /api/generate streamed"]
    adapter = adapter_class("ollama")("u1", engine.url, None, Probe(kind="ollama"))
    facts = _facts(adapter, streamed, API_GENERATE)
    assert (facts.prompt_tokens, facts.completion_tokens, facts.finish_reasons) == (8, 2, ["length"])
    assert facts.decode_ms == 200.0 and API_GENERATE.stream_default and API_GENERATE.stream_framing == "ndjson"


def test_ollama_down_is_unreachable():
    async def scenario(adapter):
        return await adapter.poll()

    with RecordedEngine() as engine:
        url = engine.url
    state = run(_with_client_at(url, "ollama", scenario))
    assert state.reachable is False


async def _with_client_at(url: str, kind: str, action):
    async with httpx.AsyncClient(timeout=2) as client:
        return await action(adapter_class(kind)("u1", url, client, Probe(kind=kind)))


# --- Exo --------------------------------------------------------------------------------------------
@pytest.fixture
def exo():
    fixture = load("exo")
    docs = fixture["documents"]
    with RecordedEngine({"GET /node_id": (200, docs["GET /node_id"]),
                         "GET /state": (200, docs["GET /state loading"])}) as engine:
        yield engine, docs, fixture["ids"]


def test_exo_instance_with_one_runner_loading_and_one_ready(exo):
    _, docs, ids = exo
    state = parse_state(docs["GET /state loading"])
    (instance,) = state.instances.values()
    assert instance.instance_id == ids["instance"] and instance.model_id == ids["model"]
    assert instance.backend == "MlxRing" and not instance.ready()
    n1, n2 = ids["nodes"][:2]
    assert [(s.node_id, s.start_layer, s.end_layer) for s in instance.shards] == [(n1, 0, 24), (n2, 24, 48)]
    assert instance.stages(n1, None) == {"files_present": True, "runner_process_up": True,
                                         "runner_ready": True, "first_answer": None}
    assert instance.stages(n2, None) == {"files_present": True, "runner_process_up": True,
                                         "runner_ready": False, "first_answer": None}
    assert instance.runner_on(n2).stage() == "Loading 12/24 layers"
    assert state.findings == []
    instance_id, node_id, text = cold_start_reason(state, ids["model"])
    assert (instance_id, node_id) == (ids["instance"], n2)
    assert text == (f"waited on instance {ids['instance']}: runner {ids['runners'][1]} on node mini-2 was "
                    "Loading 12/24 layers")


def test_exo_poll_request_and_ready_transition_over_http(exo):
    engine, docs, ids = exo
    answer = docs["POST /v1/chat/completions"]

    async def scenario(adapter):
        loading = await adapter.poll()
        during = _facts(adapter, [answer], CHAT)
        engine.serve("GET /state", docs["GET /state ready"])
        ready = await adapter.poll()
        after = _facts(adapter, [answer], CHAT)
        return loading, during, ready, after, adapter.cluster_view()

    found, (loading, during, ready, after, view) = run(_with_client(engine, "exo", scenario))
    assert found.kind == "exo" and found.models == (ids["model"],)
    assert (loading.ready, loading.loading) == (True, True)  # Exo takes the request; it waits
    assert during.evidence["exo.cold_start"].endswith("on node mini-2 was Loading 12/24 layers")
    assert during.evidence["exo.node_id"] == ids["nodes"][1]
    assert (ready.ready, ready.loading, ready.models) == (True, False, (ids["model"],))
    assert [e.detail.rsplit(": ", 1)[1] for e in ready.events] == ["Ready"]
    assert "exo.cold_start" not in after.evidence and after.prompt_tokens == 17
    (instance,) = view
    assert [n["stages"] for n in instance["nodes"]] == [
        {"files_present": True, "runner_process_up": True, "runner_ready": True, "first_answer": True}] * 2


def test_exo_failed_runner_timed_out_node_and_leftover_runner_are_findings_with_times(exo):
    engine, docs, ids = exo
    engine.serve("GET /state", docs["GET /state failed"])

    async def scenario(adapter):
        first = await adapter.poll()
        second = await adapter.poll()
        return first, second, _facts(adapter, [docs["POST /v1/chat/completions"]], CHAT)

    _, (first, second, facts) = run(_with_client(engine, "exo", scenario))
    texts = [f.split(" ", 1)[1] for f in first.findings]
    assert any(t.startswith(f"node mini-3 ({ids['nodes'][2]}) is still in nodeIdentities but has timed out")
               for t in texts)
    assert any(t.startswith("runner 4e5f6a7b-runner-leftover (Loaded) belongs to no instance") for t in texts)
    assert any(f"runner {ids['runners'][1]} of instance {ids['instance']} on node mini-2 failed: runner process "
               "exited with code -9; RunnerRingTransportError" in t for t in texts)
    assert any("has runners that disagree (node mini-1: Ready, node mini-2: Failed" in t for t in texts)
    # Each finding keeps the time it was first seen across polls.
    assert second.findings == first.findings
    for finding in first.findings:
        datetime.strptime(finding.split(" ", 1)[0], "%Y-%m-%dT%H:%M:%SZ")
    assert facts.evidence["exo.cold_start"].endswith("on node mini-2 was Failed: runner process exited with code -9; "
                                                     "RunnerRingTransportError: [ring] Too many send/recv errors. "
                                                     "Aborting...")


# --- SGLang -----------------------------------------------------------------------------------------
def test_sglang_probe_poll_and_cached_tokens():
    docs = load("sglang")["documents"]
    routes = {key: (200, docs[key]) for key in ("GET /get_server_info", "GET /health", "GET /metrics")}
    with RecordedEngine(routes) as engine:
        found, state = run(_with_client(engine, "sglang", lambda adapter: adapter.poll()))
        adapter = adapter_class("sglang")("u1", engine.url, None, found)
    assert (found.kind, found.version, found.models) == ("sglang", "0.5.4", ("Qwen/Qwen3-8B",))
    assert (state.ready, state.running, state.waiting) == (True, 3, 2)
    assert (state.cache_used, state.cache_capacity, state.cache_unit) == (41234.0, 300000.0, "tokens")
    facts = _facts(adapter, [docs["POST /v1/chat/completions"]], CHAT)
    assert (facts.prompt_tokens, facts.cached_tokens, facts.completion_tokens) == (812, 768, 3)


# --- LM Studio --------------------------------------------------------------------------------------
def test_lmstudio_stats_and_a_just_in_time_load():
    docs = load("lmstudio")["documents"]
    with RecordedEngine({"GET /api/v0/models": (200, docs["GET /api/v0/models"])}) as engine:
        async def scenario(adapter):
            state = await adapter.poll()
            return state, _facts(adapter, [docs["POST /api/v0/chat/completions"]], adapter.extra_routes[0])

        found, (state, facts) = run(_with_client(engine, "lmstudio", scenario))
    assert found.kind == "lmstudio" and state.models == ("meta-llama-3.1-8b-instruct",)
    stats = docs["POST /api/v0/chat/completions"]["stats"]
    assert facts.prefill_ms == stats["time_to_first_token"] * 1e3
    assert facts.decode_ms == stats["generation_time"] * 1e3
    assert (facts.prompt_tokens, facts.completion_tokens) == (24, 53)
    assert "model granite-3.0-2b-instruct was not loaded" in facts.evidence["lmstudio.cold_start"]


def test_every_fixture_cites_its_source():
    for engine in ("ollama", "exo", "sglang", "lmstudio"):
        source = load(engine)["source"]
        assert any(word in source for word in ("docs", "github", "/", ".py", ".go")), engine
        json.dumps(load(engine))  # plain JSON, served as is
