"""Issue 15: the --slo syntax, the met/missed/unknown rules, and the metrics state's arithmetic on
rows the normalizer produced (the end-to-end check is tests/test_metrics_prometheus.py)."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time

import polars as pl
import pytest

from tokentrace.analyzers.report import with_categories
from tokentrace.analyzers.slo import attainment, missed_objectives, parse_slo
from tokentrace.collector.decoding.normalize import TABLES, Batch
from tokentrace.collector.stores.store_duckdb import DuckDBStore
from tokentrace.dashboards import prometheus
from tokentrace.dashboards.prometheus import ITL, MetricsState
from tokentrace.errors import ConfigError


def test_scoped_groups_override_per_objective():
    spec = parse_slo("ttft=2s,tpot=50ms,e2e=1m; model=qwen:ttft=1s ;instance=mini-3:tpot=80ms")
    assert spec.objectives_for(None, None) == {"ttft": 2000.0, "tpot": 50.0, "e2e": 60000.0}
    assert spec.objectives_for("qwen", "mini-1") == {"ttft": 1000.0, "tpot": 50.0, "e2e": 60000.0}
    assert spec.objectives_for("qwen", "mini-3") == {"ttft": 1000.0, "tpot": 80.0, "e2e": 60000.0}
    assert spec.names() == ["ttft", "tpot", "e2e"]
    assert parse_slo("") is None and parse_slo(None) is None


@pytest.mark.parametrize(("text", "fragment"), [
    ("ttft=2", "must be a duration such as 500ms"),
    ("latency=2s", "objectives are ttft=, first_token=, tpot= and e2e="),
    ("gpu=a:ttft=1s", "starts with model=NAME: or instance=NAME:"),
    (";", "names no objective"),
])
def test_bad_specs_say_what_was_expected(text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_slo(text)


def test_collector_refuses_a_bad_slo_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tokentrace", "collector", "--db", str(tmp_path / "x.duckdb"),
                          "--slo", "ttft=fast"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--slo must be objectives like ttft=2s" in out.stderr and "'ttft=fast'" in out.stderr


def _frame(rows: list[dict]) -> pl.DataFrame:
    base = dict.fromkeys(TABLES["requests"])
    full = [{**base, "request_id": f"r{i}", "trace_id": "t", "span_id": "s", "instance_id": "a", "model": "m",
             "start_ns": 0, "end_ns": 1_000_000_000, **row} for i, row in enumerate(rows)]
    return with_categories(pl.DataFrame(full, schema_overrides={"http_status": pl.Int64,
                                                                 "error_type": pl.Utf8, "finish_reason": pl.Utf8,
                                                                 "client_disconnected": pl.Boolean}))


def test_met_missed_unknown_and_good():
    # Issue 44: ``ttft`` is the client's time to first content; ``first_token`` the engine's time to
    # first token (what ``ttft`` judged before, up to seconds earlier than what the client saw).
    spec = parse_slo("ttft=100ms,first_token=60ms,tpot=10ms")
    frame = _frame([
        {"ttft_ms": 50.0, "first_content_ms": 60.0, "tpot_ms": 5.0},   # meets all: good
        {"ttft_ms": 50.0, "first_content_ms": 150.0, "tpot_ms": 5.0},  # the client waited 150 ms: misses ttft
        {"ttft_ms": 50.0, "first_content_ms": 70.0, "tpot_ms": None},  # tpot unknown (one token): still good
        {"ttft_ms": 50.0, "first_content_ms": 60.0, "tpot_ms": 5.0, "http_status": 500},  # failed: never good
        {"ttft_ms": 120.0, "first_content_ms": None, "tpot_ms": 5.0},  # first content unmeasured, first token late
        {"ttft_ms": 50.0, "first_content_ms": None, "tpot_ms": 5.0},   # first content unmeasured: ttft unknown
    ])
    result = attainment(frame, spec, active_s=2.0)
    assert result["objectives"]["ttft"] == {"measure": "first_content_ms", "what": "time to first content (the "
                                            "client's TTFT)", "met": 3, "missed": 2, "unknown": 1, "attainment": 0.6}
    assert result["objectives"]["first_token"] == {"measure": "ttft_ms", "what": "time to first token (the engine's)",
                                                   "met": 5, "missed": 1, "unknown": 0, "attainment": 0.8333}
    assert result["objectives"]["tpot"]["met"] == 5 and result["objectives"]["tpot"]["unknown"] == 1
    assert result["all"] == {"requests": 6, "good": 3, "attainment": 0.5, "goodput_rps": 1.5}
    assert missed_objectives(frame.row(1, named=True), spec) == [
        {"slo": "ttft", "objective_ms": 100.0, "observed_ms": 150.0, "measure": "first_content_ms"}]
    # Time to first content is never earlier than time to first token: a late first token is a miss.
    assert missed_objectives(frame.row(4, named=True), spec) == [
        {"slo": "ttft", "objective_ms": 100.0, "observed_ms": 120.0, "measure": "ttft_ms"},
        {"slo": "first_token", "objective_ms": 60.0, "observed_ms": 120.0, "measure": "ttft_ms"}]
    assert missed_objectives(frame.row(5, named=True), spec) == []
    assert missed_objectives(frame.row(1, named=True), None) == []


def _counted(state: MetricsState, timeout: float = 60.0) -> None:
    """Until the verdict thread counted every queued request (polling the state's own queue: nothing
    else to wait on)."""
    deadline = time.monotonic() + timeout
    while state.drain_verdicts() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state.drain_verdicts() == 0


def _request_row(rid: str, instance: str, ttft_ms: float, start_ns: int = 0) -> tuple:
    row = dict.fromkeys(TABLES["requests"])
    row.update(request_id=rid, trace_id="t" + rid, span_id="s" + rid, instance_id=instance, model="m",
               start_ns=start_ns, end_ns=start_ns + 3_000_000_000, ttft_ms=ttft_ms, queue_ms=1.0, load_wait_ms=0.0,
               prefill_ms=ttft_ms - 1, decode_ms=10.0, tpot_ms=5.0, prompt_tokens=10, cached_tokens=9,
               completion_tokens=3, finish_reason="stop")
    return tuple(row[name] for name in TABLES["requests"])


def test_histograms_and_inter_token_gaps(tmp_path):
    store = DuckDBStore(tmp_path / "m.duckdb")
    state = MetricsState(store, parse_slo("first_token=100ms"))
    try:
        batch = Batch()
        # 1 ms and 100 ms fall on bucket bounds (le is inclusive); 3 s lands in the 5 s bucket.
        batch.rows["requests"] += [_request_row("a", "i1", 1.0), _request_row("b", "i1", 100.0),
                                   _request_row("c", "i2", 3000.0)]
        # Two requests' step offsets on one instance: gaps are taken within each request only.
        eviction = dict.fromkeys(TABLES["cache_evictions"])
        eviction.update(instance_id="i1", t_ns=5, reason="max_bytes")
        batch.rows["cache_evictions"] += [tuple(eviction[name] for name in TABLES["cache_evictions"])] * 2
        batch.packed["decode_steps"] += [("a", "i1", 0, [0, 10_000_000, 30_000_000]),
                                         ("b", "i1", 0, [5_000_000_000, 5_050_000_000]), ("c", "i2", 0, [7])]
        state.observe(batch)
        state.render({"accepted_spans": 0, "rejected": {}})  # folds: the requests are queued for verdicts
        # A request's latencies are folded with its verdicts, from the row they read; these rows are
        # in no store (the verdicts fail), so the rows folded give them.
        _counted(state)
        text = state.render({"accepted_spans": 0, "rejected": {}})
    finally:
        state.close()
        store.close()
    lines = set(text.splitlines())
    labels = 'model_name="m",engine="0",instance_id="i1"'
    assert f'vllm:time_to_first_token_seconds_bucket{{{labels},le="0.001"}} 1' in lines
    assert f'vllm:time_to_first_token_seconds_bucket{{{labels},le="0.08"}} 1' in lines
    assert f'vllm:time_to_first_token_seconds_bucket{{{labels},le="0.1"}} 2' in lines
    assert f'vllm:time_to_first_token_seconds_count{{{labels}}} 2' in lines
    i2 = 'model_name="m",engine="0",instance_id="i2"'
    assert f'vllm:time_to_first_token_seconds_bucket{{{i2},le="2.5"}} 0' in lines
    assert f'vllm:time_to_first_token_seconds_bucket{{{i2},le="5.0"}} 1' in lines
    # Gaps 10 ms, 20 ms (request a) and 50 ms (request b); nothing across the two requests.
    assert f"{ITL}_count{{{labels}}} 3" in lines
    assert f"{ITL}_bucket{{{labels},le=\"0.01\"}} 1" in lines and f"{ITL}_bucket{{{labels},le=\"0.025\"}} 2" in lines
    assert not any(line.startswith(f"{ITL}_count{{{i2}") for line in lines)  # one token: no gap known
    assert f'tokentrace_slo_requests_total{{{labels},slo="first_token",met="true"}} 2' in lines
    assert f'tokentrace_slo_requests_total{{{i2},slo="first_token",met="false"}} 1' in lines
    assert f'vllm:prefix_cache_hits_total{{{labels}}} 18' in lines
    assert f'tokentrace_cache_evictions_total{{{labels},reason="max_bytes"}} 2' in lines


def test_rows_that_know_little_are_counted_without_inventing_values(tmp_path):
    """A gateway or vLLM-native row: no queue, no cached tokens, no phases, no finish reason."""
    row = dict.fromkeys(TABLES["requests"])
    row.update(request_id="g-1", trace_id="t", span_id="s", instance_id="gw", start_ns=0, end_ns=2_000_000_000,
               ttft_ms=None, prompt_tokens=None)
    store = DuckDBStore(tmp_path / "g.duckdb")
    state = MetricsState(store, parse_slo("ttft=1s,e2e=10s"))
    try:
        batch = Batch()
        batch.rows["requests"].append(tuple(row[name] for name in TABLES["requests"]))
        state.observe(batch)
        state.render({"accepted_spans": 1, "rejected": {}})  # folds the row: its verdicts are queued
        _counted(state)
        text = state.render({"accepted_spans": 1, "rejected": {}})
    finally:
        state.close()
        store.close()
    assert "tokentrace_metrics_fold_errors" not in text
    gw = 'model_name="unknown",engine="0",instance_id="gw"'
    assert f'tokentrace_requests_total{{{gw},outcome="completed",category="undecomposed"}} 1' in text
    assert f"vllm:e2e_request_latency_seconds_count{{{gw}}} 1" in text
    for absent in ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds", "vllm:prefix_cache_hits",
                   "vllm:prompt_tokens_total", 'slo="ttft"'):
        assert absent not in text, absent
    assert f'tokentrace_slo_requests_total{{{gw},slo="e2e",met="true"}} 1' in text


def test_avoidable_prefill_comes_from_the_gateways_routing_decisions(tmp_path):
    def route(rid: str, tokens: int | None, held_by: str | None) -> tuple:
        row = dict.fromkeys(TABLES["routes"])
        row.update(request_id=rid, trace_id="t", span_id="s", instance_id="up-b", start_ns=0, end_ns=1,
                   avoidable_prefill_tokens=tokens, avoidable_from=held_by)
        return tuple(row[name] for name in TABLES["routes"])

    store = DuckDBStore(tmp_path / "r.duckdb")
    state = MetricsState(store, None)
    try:
        batch = Batch()
        batch.rows["routes"] += [route("1", 96, "up-a"), route("2", 32, "up-a"), route("3", None, None)]
        state.observe(batch)
        text = state.render({"accepted_spans": 0, "rejected": {}})
    finally:
        state.close()
        store.close()
    labels = 'model_name="unknown",engine="0",instance_id="up-b",held_by="up-a"'
    assert f"tokentrace_avoidable_prefill_tokens_total{{{labels}}} 128" in text.splitlines()


def test_batches_handed_over_during_a_verdict_pause_are_folded_in_it(tmp_path, monkeypatch):
    """While ingest is busy the verdict thread pauses three times as long as each verdict took, and
    a verdict waits for the merge: batches handed over meanwhile waited for the pause to end (850,000
    rows under overload). The pause folds them as they come, and the collector's stop ends it."""
    monkeypatch.setattr(prometheus, "FOLD_AT_ROWS", 1)
    # The state's own thread would fold an idle wait's batches too; here the pause is the only folder.
    monkeypatch.setattr(MetricsState, "_verdict_loop", lambda self: None)
    store = DuckDBStore(tmp_path / "m.duckdb")
    state = MetricsState(store)
    pause = threading.Thread(target=state._pause, args=(time.monotonic() + 600,))
    try:
        pause.start()
        batch = Batch()
        batch.rows["requests"] += [_request_row("a", "i1", 1.0)]
        state.observe(batch)
        with state._lock:  # a fold runs under this lock: once it is free and nothing waits, it ran
            assert state._wake.wait_for(lambda: state._pending_rows == 0, timeout=30)
        assert pause.is_alive()  # folded inside the pause, not after it
    finally:
        state.close()
        pause.join(30)
    assert not pause.is_alive()
    # The completed request folded in the pause is counted with its verdicts (queued until then).
    assert state.drain_verdicts() == 1 or "tokentrace_requests_total" in state.render({"accepted_spans": 0,
                                                                                      "rejected": {}})


def test_the_metrics_verdicts_read_patiently_on_their_own_thread(tmp_path):
    """/metrics' verdict thread must never hurry the store's merges (issue 17: its reads kept every
    merge small while ingesting), so it reads patiently; and it yields to ingest in proportion to each
    verdict's wall time, so its verdicts read one after the other on its own thread (reads at once
    made them shorter, not cheaper: ingest's p99 went from 70-79 to 126-136 ms)."""
    store = DuckDBStore(tmp_path / "p.duckdb")
    reads: list[tuple[str, bool]] = []
    rows = store.rows

    def recording(name, **params):
        reads.append((threading.current_thread().name, getattr(store._local, "patient", False)))
        return rows(name, **params)

    store.rows = recording
    state = MetricsState(store)
    try:
        batch = Batch()
        row = dict(zip(TABLES["requests"], _request_row("miss", "i1", 40.0), strict=True))
        row.update(cached_tokens=0, prompt_tokens=400)  # a miss: its cache verdict reads the store
        batch.rows["requests"].append(tuple(row[name] for name in TABLES["requests"]))
        store.write(batch)
        state.observe(batch)
        state.render({"accepted_spans": 0, "rejected": {}})  # folds the batch: its verdict is queued
        deadline = time.monotonic() + 60
        while (state.drain_verdicts() or not reads) and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the state's own queue: nothing else to wait on
    finally:
        state.close()
        store.close()
    assert reads and set(reads) == {("tokentrace-metrics", True)}, reads


def test_requests_past_the_verdict_queues_room_are_counted_skipped(tmp_path):
    """Completed requests past the verdict queue's room are counted as skipped at once (issue 17);
    the failed ones get no verdict. (The in-memory baseline this test also held to baseline.sql is
    gone: /metrics' verdicts are the analyzers' own over the store, issue 44.)"""
    store = DuckDBStore(tmp_path / "b.duckdb")
    state = MetricsState(store, max_pending_verdicts=0)
    rng = random.Random(7)
    starts = rng.sample(range(1, 3200), 1200)
    rows = []
    for n, start in enumerate(starts):
        row = dict(zip(TABLES["requests"], _request_row(f"r{n}", "i1" if n % 9 else "i2", 5.0 + n % 13,
                                                        start_ns=start * 1_000_000_000), strict=True))
        row["http_status"] = 500 if n % 17 == 0 else None
        rows.append(tuple(row.values()))
    try:
        for at in range(0, len(rows), 250):
            batch = Batch()
            batch.rows["requests"] += rows[at:at + 250]
            store.write(batch)
            state.observe(batch)
        text = state.render({"accepted_spans": 0, "rejected": {}})
        completed = sum(1 for n in range(len(rows)) if n % 17)  # the failed ones get no verdict
        assert f"tokentrace_verdicts_skipped_total {completed}" in text.splitlines()
    finally:
        state.close()
        store.close()


def test_a_verdict_waits_for_the_second_observers_row(tmp_path, monkeypatch):
    """Issue 44 (truth matrix, vLLM behind the gateway): on an instance that a gateway and an observer
    inside the engine both report, a request's verdicts wait for its second row (up to
    PARTNER_WAIT_LONG_S), so that /metrics counts the merged request's category; judged on the
    gateway's row alone after PARTNER_WAIT_S, it was counted undecomposed where analyze slow says
    prefill."""
    monkeypatch.setattr(prometheus, "PARTNER_WAIT_LONG_S", 600.0)

    def row(rid: str, observer: str) -> tuple:
        values = dict(zip(TABLES["requests"], _request_row(rid, "i1", 50.0), strict=True))
        # A prefill-bound request: its phases (queue 1, prefill 49, decode 10 ms) fill its 61 ms, and
        # no more of it is in no phase than in its prefill (outcome.unattributed).
        values.update(observer=observer, end_ns=values["start_ns"] + 61_000_000)
        if observer == "gateway":  # the client's view: no phase of the engine's known
            values.update(queue_ms=0.0, load_wait_ms=None, prefill_ms=None, decode_ms=None, ttft_ms=None,
                          tpot_ms=None, cached_tokens=None)
        return tuple(values[name] for name in TABLES["requests"])

    def hand_over(*rows: tuple) -> None:
        batch = Batch()
        batch.rows["requests"] += list(rows)
        store.write(batch)
        state.observe(batch)
        state.render({"accepted_spans": 0, "rejected": {}})  # folds it: its verdicts are queued

    store = DuckDBStore(tmp_path / "pair.duckdb")
    state = MetricsState(store)
    try:
        hand_over(row("warm", "gateway"), row("warm", "engine"))  # both sides report i1
        deadline = time.monotonic() + 60
        while state.drain_verdicts() and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the state's own queue: nothing else to wait on
        hand_over(row("late", "gateway"))
        with state._lock:
            assert state._verdicts[0][2] == "late" and state._due() - time.monotonic() > 500
        hand_over(row("late", "engine"))  # its second row: judged soon after, merged
        with state._lock:
            assert state._due() - time.monotonic() <= prometheus.PARTNER_WAIT_S
        # The engine generated to the end for a client that had hung up at the gateway: the merged
        # request is cancelled, counted so, and not among the cache lookups (vLLM behind the gateway).
        gone = dict(zip(TABLES["requests"], row("gone", "gateway"), strict=True))
        gone.update(client_disconnected=True, http_status=200)
        hand_over(row("gone", "engine"), tuple(gone[name] for name in TABLES["requests"]))
        _counted(state)
        text = state.render({"accepted_spans": 0, "rejected": {}})
    finally:
        state.close()
        store.close()
    i1 = 'model_name="m",engine="0",instance_id="i1"'
    assert f'tokentrace_requests_total{{{i1},outcome="completed",category="prefill"}} 2' in text.splitlines()
    assert f'tokentrace_requests_total{{{i1},outcome="cancelled",category="cancelled"}} 1' in text.splitlines()
    lookups = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("tokentrace_cache_lookups_total{"))
    assert lookups == 2, text
    assert not [line for line in text.splitlines() if line.startswith("tokentrace_requests_total")
                and "undecomposed" in line]
