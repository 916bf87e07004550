"""Issue 3 acceptance: real engine processes, a real collector, SQL on its DuckDB file.

The first group shares one run (collector + engine, a scripted conversation); every other bullet
starts the engine configuration it needs. The collector is stopped before its file is queried.
"""

from __future__ import annotations

import itertools
import json
import signal
import threading

import httpx
import pytest
from harness_collector import CollectorProcess, wait_for
from harness_engine import EngineProcess, streamed_text

pytestmark = pytest.mark.slow

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly and cite your sources. " * 3}
TURN_1 = [SYSTEM, {"role": "user", "content": "Why was this request slow? It waited behind a long generation."}]
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V x layers x kv heads x head dim x float32 (tiny)


def _one(collector: CollectorProcess, query: str, params: list | None = None):
    rows = collector.sql(query, params)
    assert len(rows) == 1, rows
    return rows[0]


@pytest.fixture(scope="module")
def conversation(tmp_path_factory, tiny_model):
    """One engine run: two turns of a conversation, a client that leaves mid-stream, bad requests."""
    workdir = tmp_path_factory.mktemp("conversation")
    collector = CollectorProcess(workdir).start()
    engine = EngineProcess(workdir, tiny_model, "--prefill-step-size", "32", "--heartbeat-interval", "0.5",
                           collector=collector).start()
    run = {"collector": collector}
    try:
        first = engine.chat(TURN_1, headers={"X-Request-Id": "turn-1", "X-Session-Id": "s-1"},
                            max_tokens=16, ignore_eos=True)
        run["turn-1"] = first.json()
        turn_2 = [*TURN_1, first.json()["choices"][0]["message"], {"role": "user", "content": "Tell me more."}]
        run["turn-2"] = engine.chat(turn_2, headers={"X-Request-Id": "turn-2"}, user="s-1", max_tokens=8).json()
        with httpx.stream("POST", engine.url + "/v1/completions", headers={"X-Request-Id": "gone"}, timeout=60,
                          json={"prompt": "Tell a long story", "max_tokens": 1500, "ignore_eos": True,
                                "stream": True}) as response:
            lines = response.iter_lines()
            run["gone-events"] = [next(lines) for _ in range(6)]
        # A long stop string holds text back (it could still become the stop string), so the first
        # chunk with content leaves several tokens after the first token: the two TTFTs differ.
        run["held-back"] = engine.stream("/v1/completions", {"prompt": "Once", "max_tokens": 40, "ignore_eos": True,
                                                             "stop": ["this stop string never appears"]},
                                         headers={"X-Request-Id": "held-back"})[0]
        run["bad"] = engine.post("/v1/chat/completions", {"messages": TURN_1, "max_tokens": 0},
                                 headers={"X-Request-Id": "bad-1"})
        run["after-bad"] = engine.chat(TURN_1, headers={"X-Request-Id": "after-bad"}, max_tokens=2)
    finally:
        assert engine.stop() == 0, engine.log_path.read_text()
        collector.stop()
    return run


def test_one_request_produces_the_whole_span_tree(conversation):
    collector = conversation["collector"]
    names = {row[0] for row in collector.sql("SELECT name FROM spans WHERE request_id = 'turn-1'")}
    assert names == {"llm.request", "llm.queue", "llm.cache.lookup", "llm.prefill", "llm.prefill.chunk",
                     "llm.decode", "llm.cache.insert"}
    assert _one(collector, "SELECT count(DISTINCT trace_id) FROM spans WHERE request_id = 'turn-1'") == (1,)
    root_start, root_end, root_id = _one(collector, "SELECT start_ns, end_ns, span_id FROM spans "
                                                    "WHERE request_id = 'turn-1' AND name = 'llm.request'")
    for name, start, end in collector.sql("SELECT name, start_ns, end_ns FROM spans WHERE request_id = 'turn-1'"):
        assert root_start <= start <= end <= root_end, name
    assert collector.sql("SELECT DISTINCT parent_span_id FROM spans WHERE request_id = 'turn-1' AND name IN "
                         "('llm.queue', 'llm.cache.lookup', 'llm.prefill', 'llm.decode', 'llm.cache.insert')") \
        == [(root_id,)]
    prefill_start, prefill_end = _one(collector, "SELECT start_ns, end_ns FROM phases "
                                                 "WHERE request_id = 'turn-1' AND name = 'llm.prefill'")
    chunks = collector.sql("SELECT start_ns, end_ns, chunk_offset, tokens FROM prefill_chunks "
                           "WHERE request_id = 'turn-1' ORDER BY chunk_offset")
    assert len(chunks) > 2  # --prefill-step-size 32 splits the prompt
    assert all(prefill_start <= s <= e <= prefill_end for s, e, _, _ in chunks)
    assert all(a[2] + a[3] == b[2] for a, b in itertools.pairwise(chunks))  # contiguous
    prompt, cached, completion = _one(collector, "SELECT prompt_tokens, cached_tokens, completion_tokens "
                                                 "FROM requests WHERE request_id = 'turn-1'")
    assert sum(c[3] for c in chunks) == prompt - cached
    assert _one(collector, "SELECT count(*) FROM decode_steps WHERE request_id = 'turn-1'") == (completion,)
    usage = conversation["turn-1"]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"]) \
        == (prompt, completion, cached) == (prompt, 16, 0)


def test_request_row_carries_the_phase_summary(conversation):
    row = _one(conversation["collector"], "SELECT session_id, endpoint, finish_reason, streamed, http_status, "
               "queue_ms >= 0, prefill_ms > 0, decode_ms > 0, ttft_ms >= prefill_ms, tpot_ms > 0, instance_id, "
               "engine FROM requests WHERE request_id = 'turn-1'")
    assert row == ("s-1", "/v1/chat/completions", "length", False, 200, True, True, True, True, True,
                   "engine-a", "mlx-lm")


def test_first_content_is_recorded_next_to_the_first_token(conversation):
    collector = conversation["collector"]
    assert streamed_text(conversation["held-back"])
    ttft, first_content, e2e = _one(collector, "SELECT ttft_ms, first_content_ms, (end_ns - start_ns) / 1e6 "
                                               "FROM requests WHERE request_id = 'held-back'")
    assert ttft < first_content <= e2e
    (attribute,) = _one(collector, "SELECT attributes FROM spans WHERE request_id = 'held-back' "
                                   "AND name = 'llm.request'")
    assert json.loads(attribute)["tokentrace.request.first_content_ms"] == pytest.approx(first_content)
    # A non-streamed answer's content leaves with the whole body, after the last token.
    decode_end, content = _one(collector, "SELECT ttft_ms + decode_ms, first_content_ms FROM requests "
                                          "WHERE request_id = 'turn-1'")
    assert content >= decode_end
    assert _one(collector, "SELECT first_content_ms FROM requests WHERE request_id = 'bad-1'") == (None,)


def test_second_turn_reports_cached_tokens_in_usage_and_store(conversation):
    collector = conversation["collector"]
    cached = conversation["turn-2"]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert _one(collector, "SELECT cached_tokens, session_id FROM requests WHERE request_id = 'turn-2'") \
        == (cached, "s-1")
    assert _one(collector, "SELECT matched_tokens, match FROM cache_lookups WHERE request_id = 'turn-2'") \
        == (cached, "prefix")
    # turn 2 reused the entry turn 1 stored, and its prompt shares turn 1's leading block hashes
    entry = _one(collector, "SELECT fingerprint FROM cache_inserts WHERE request_id = 'turn-1'")[0]
    assert _one(collector, "SELECT matched_entry FROM cache_lookups WHERE request_id = 'turn-2'") == (entry,)
    shared = _one(collector, "SELECT count(*) FROM prefix_blocks a JOIN prefix_blocks b USING (block_index, hash) "
                  "WHERE a.request_id = 'turn-1' AND a.source = 'insert' "
                  "AND b.request_id = 'turn-2' AND b.source = 'lookup'")[0]
    assert shared == cached // 16


def test_segments_name_each_message_with_stable_content_hashes(conversation):
    collector = conversation["collector"]
    rows = {rid: collector.sql("SELECT role, token_start, token_end, hash FROM segments WHERE request_id = ? "
                               "ORDER BY segment_index", [rid]) for rid in ("turn-1", "turn-2")}
    assert [r[0] for r in rows["turn-1"]] == ["system", "user", "assistant"]
    assert [r[0] for r in rows["turn-2"]] == ["system", "user", "assistant", "user", "assistant"]
    assert rows["turn-1"][:2] == rows["turn-2"][:2]  # same system prompt and first question
    assert all(a[2] == b[1] for a, b in zip(rows["turn-2"], rows["turn-2"][1:], strict=False))
    assert collector.sql("SELECT count(*) FROM segments WHERE snippet IS NOT NULL") == [(0,)]  # no prompt text


def test_client_disconnect_cancels_generation_and_is_recorded(conversation):
    collector = conversation["collector"]
    assert conversation["gone-events"][0].startswith("data: ")
    row = _one(collector, "SELECT client_disconnected, finish_reason, completion_tokens, streamed "
                          "FROM requests WHERE request_id = 'gone'")
    assert row[0] is True and row[1] == "cancelled" and row[3] is True
    assert 0 < row[2] < 1500
    assert _one(collector, "SELECT count(*) FROM decode_steps WHERE request_id = 'gone'") == (row[2],)
    # the generation stopped: the steps after its last token no longer carry it
    last_token = _one(collector, "SELECT max(t_ns) FROM decode_steps WHERE request_id = 'gone'")[0]
    later = collector.sql("SELECT count(*) FROM steps WHERE start_ns > ? + 1000000000 AND "
                          "list_contains(decode_request_ids, 'gone')", [last_token])
    assert later == [(0,)]


def test_malformed_request_is_a_400_on_the_wire_and_in_the_store(conversation):
    collector = conversation["collector"]
    bad = conversation["bad"]
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    assert conversation["after-bad"].status_code == 200
    assert _one(collector, "SELECT http_status, error_type FROM requests WHERE request_id = 'bad-1'") \
        == (400, "invalid_request_error")


def test_instance_reports_load_lifecycle_heartbeats_and_steps(conversation):
    collector = conversation["collector"]
    load_id, lazy = _one(collector, "SELECT load_id, lazy FROM model_loads")
    assert lazy is False
    stages = collector.sql("SELECT name FROM load_stages WHERE load_id = ? ORDER BY start_ns", [load_id])
    assert [s[0] for s in stages] == ["model.load.resolve", "model.load.weights", "model.load.tokenizer",
                                      "model.load.warmup"]
    events = [e[0] for e in collector.sql("SELECT event FROM instance_events ORDER BY t_ns")]
    assert events == ["instance.started", "instance.ready", "instance.first_response", "instance.stopped"]
    assert _one(collector, "SELECT DISTINCT kv_bytes_per_token, max_batch FROM heartbeats") \
        == (KV_BYTES_PER_TOKEN, 8)
    # engine.steps: every token of turn-1 was produced in a step that lists it as decoding
    decoding = _one(collector, "SELECT count(*) FROM steps WHERE list_contains(decode_request_ids, 'turn-1')")[0]
    assert decoding == 16
    prefill = _one(collector, "SELECT sum(prefill_tokens) FROM steps "
                              "WHERE list_contains(prefill_request_ids, 'turn-1')")[0]
    assert prefill == conversation["turn-1"]["usage"]["prompt_tokens"]
    assert _one(collector, "SELECT DISTINCT instance_id, engine, service_name FROM resources") \
        == ("engine-a", "mlx-lm", "tokentrace-engine")


def _long_prompt(i: int, length: int = 120) -> list[int]:
    return [3 + (i * 37 + k * 11) % 400 for k in range(length)]


@pytest.mark.parametrize(("option", "value", "reason"), [
    ("--cache-max-entries", "2", "max_entries"),
    ("--cache-max-bytes", str(int(2.5 * 124 * KV_BYTES_PER_TOKEN)), "max_bytes"),
])
def test_cache_limit_evicts_the_first_prompt_with_its_fingerprint(collector_factory, engine_factory, option,
                                                                    value, reason):
    collector = collector_factory().start()
    engine = engine_factory(option, value, collector=collector).start()
    for i in range(4):
        response = engine.post("/v1/completions", {"prompt": _long_prompt(i), "max_tokens": 4, "ignore_eos": True},
                               headers={"X-Request-Id": f"p{i}"})
        assert response.status_code == 200
    engine.stop()
    collector.stop()
    evictions = collector.sql("SELECT entry_request_id, evicted_by_request_id, reason, fingerprint, tokens "
                              "FROM cache_evictions ORDER BY t_ns")
    assert evictions[0][:3] == ("p0", "p2", reason)
    assert [e[0] for e in evictions] == ["p0", "p1"]
    inserted = _one(collector, "SELECT fingerprint, tokens FROM cache_inserts WHERE request_id = 'p0'")
    assert evictions[0][3:] == inserted
    assert _one(collector, "SELECT cache_entries FROM cache_inserts WHERE request_id = 'p3'") == (2,)


def test_queue_span_covers_the_wait_behind_a_long_generation(collector_factory, engine_factory):
    collector = collector_factory().start()
    engine = engine_factory("--max-batch", "1", collector=collector).start()
    started = threading.Event()

    def long_generation():
        with httpx.stream("POST", engine.url + "/v1/completions", headers={"X-Request-Id": "long"}, timeout=120,
                          json={"prompt": "Once", "max_tokens": 800, "ignore_eos": True, "stream": True}) as r:
            for _ in r.iter_lines():
                started.set()

    blocker = threading.Thread(target=long_generation)
    blocker.start()
    assert started.wait(60)
    behind = engine.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, headers={"X-Request-Id": "behind"})
    blocker.join(120)
    assert behind.status_code == 200
    engine.stop()
    collector.stop()
    long_last_token = _one(collector, "SELECT max(t_ns) FROM decode_steps WHERE request_id = 'long'")[0]
    start, end, depth, running, batch = _one(collector, "SELECT start_ns, end_ns, queue_depth, queue_running, "
                                                        "max_batch FROM phases WHERE request_id = 'behind' "
                                                        "AND name = 'llm.queue'")
    assert start < long_last_token <= end
    assert (depth, running, batch) == (0, 1, 1)
    queue_ms = _one(collector, "SELECT queue_ms FROM requests WHERE request_id = 'behind'")[0]
    assert queue_ms == pytest.approx((end - start) / 1e6)


def test_lazy_load_request_waits_inside_the_model_load(collector_factory, engine_factory):
    collector = collector_factory().start()
    engine = engine_factory("--lazy-load", collector=collector).start(ready=False)
    assert httpx.get(engine.url + "/health").json() == {"status": "not_loaded"}
    response = engine.chat(TURN_1, headers={"X-Request-Id": "cold"}, max_tokens=2)
    assert response.status_code == 200
    assert httpx.get(engine.url + "/health").status_code == 200
    engine.stop()
    collector.stop()
    load_id, load_start, load_end, lazy = _one(collector, "SELECT load_id, start_ns, end_ns, lazy FROM model_loads")
    assert lazy is True
    wait_start, wait_end, cited = _one(collector, "SELECT start_ns, end_ns, load_id FROM phases "
                                                  "WHERE request_id = 'cold' AND name = 'llm.load_wait'")
    assert cited == load_id
    assert load_start <= wait_start < wait_end <= load_end
    load_wait_ms = _one(collector, "SELECT load_wait_ms FROM requests WHERE request_id = 'cold'")[0]
    assert load_wait_ms == pytest.approx((wait_end - wait_start) / 1e6)


#: Loaded into the engine through PYTHONPATH: on SIGUSR1 it writes how many objects the garbage
#: collector tracks and how many are frozen (skipped by every collection) as one JSON document.
HEAP_PROBE = """
import gc, json, os, signal

def _report(signum, frame):
    path = os.environ["TOKENTRACE_TEST_HEAP_PROBE"]
    with open(path + ".part", "w") as out:
        json.dump({"tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count()}, out)
    os.replace(path + ".part", path)

signal.signal(signal.SIGUSR1, _report)
"""


def test_a_lazy_load_freezes_the_heap_it_leaves(tmp_path, monkeypatch, collector_factory, engine_factory):
    """The load leaves ~100k long-lived objects (mlx-lm, the tokenizer). Unfrozen, their first full
    collection falls on whatever runs next: 50-70 ms holding the GIL, enough to make the demo's first
    request after a lazy load a prefill rather than a cold start (CI once saw that verdict). The load
    now collects and freezes them, inside its warm-up stage."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(HEAP_PROBE)
    report = tmp_path / "heap.json"
    monkeypatch.setenv("PYTHONPATH", str(probe))
    monkeypatch.setenv("TOKENTRACE_TEST_HEAP_PROBE", str(report))
    collector = collector_factory().start()
    engine = engine_factory("--lazy-load", collector=collector).start(ready=False)
    assert engine.chat(TURN_1, headers={"X-Request-Id": "cold"}, max_tokens=2).status_code == 200
    engine.proc.send_signal(signal.SIGUSR1)
    heap = json.loads(wait_for(lambda: report.exists() and report.read_text(), 30, "the heap report"))
    engine.stop()
    collector.stop()
    assert heap["frozen"] > 50_000, heap
    assert heap["tracked"] < heap["frozen"] / 4, heap  # a full collection now scans what serving made


def test_eight_concurrent_streams_survive_a_collector_outage(tmp_path, collector_factory, engine_factory):
    collector = collector_factory().start()
    engine = engine_factory("--max-batch", "8", collector=collector).start()
    prompts = [[{"role": "user", "content": f"Question number {i}: what happened in the year {1900 + 7 * i}?"}]
               for i in range(8)]
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    first_chunks = threading.Barrier(9)

    def client(i: int) -> None:
        try:
            body = {"messages": prompts[i], "max_tokens": 48, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            events = []
            with httpx.stream("POST", engine.url + "/v1/chat/completions", json=body, timeout=120,
                              headers={"X-Request-Id": f"stream-{i}"}) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        if len(events) == 1:
                            first_chunks.wait(60)
            results[i] = events
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            first_chunks.abort()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    first_chunks.wait(60)
    collector.kill()  # mid-run: every client has its first chunk, none has its last
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    # Every answer is complete and correct: the same prompt answered alone gives the same text.
    for i in range(8):
        usage = results[i][-1]["usage"]
        assert usage["completion_tokens"] == 48
        alone = engine.chat(prompts[i], max_tokens=48, ignore_eos=True, headers={"X-Request-Id": f"alone-{i}"})
        assert streamed_text(results[i][:-1]) == alone.json()["choices"][0]["message"]["content"]
    spool = engine.spool_dir
    wait_for(lambda: list(spool.glob("*.pb")), 30, "spans spooled while the collector is down")
    restarted = collector_factory(db=collector.db)
    restarted.port = collector.port
    restarted.start()
    wait_for(lambda: not list(spool.glob("*.pb*")), 60, "the engine to resend its spool")
    engine.stop()
    restarted.stop()
    ids = {row[0] for row in restarted.sql("SELECT DISTINCT request_id FROM requests")}
    assert ids >= {f"stream-{i}" for i in range(8)} | {f"alone-{i}" for i in range(8)}
    rows = restarted.sql("SELECT request_id, max(completion_tokens), count(DISTINCT step) FROM requests "
                         "JOIN decode_steps USING (request_id) WHERE request_id LIKE 'stream-%' GROUP BY 1")
    assert sorted(rows) == [(f"stream-{i}", 48, 48) for i in range(8)]


def test_capture_content_stores_bounded_snippets_only_when_asked(collector_factory, engine_factory):
    collector = collector_factory().start()
    engine = engine_factory("--capture-content", collector=collector).start()
    secret = "the launch code is 0000 " * 20
    assert engine.chat([SYSTEM, {"role": "user", "content": secret}], max_tokens=2,
                       headers={"X-Request-Id": "captured"}).status_code == 200
    engine.stop()
    collector.stop()
    snippets = [row[0] for row in collector.sql("SELECT snippet FROM segments WHERE request_id = 'captured' "
                                                "ORDER BY segment_index")]
    assert len(snippets) == 3 and all(0 < len(s) <= 96 for s in snippets)
    assert "launch code" in snippets[1] and "…" in snippets[1]
    attributes = " ".join(row[0] for row in collector.sql("SELECT attributes FROM spans WHERE request_id = 'captured' "
                                                          "AND name <> 'llm.cache.lookup'"))
    assert "launch code" not in attributes
