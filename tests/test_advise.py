"""``tokentrace analyze advise`` (issue 47 item 1): on a workload built with one known lever of each
kind, on real engines, the advice ranks that lever's change first within its kind, and its figures
agree within 10 % with a computation made here, independently, from the same requests' rows:

- context (``ctx-``, engine adv-ctx): sessions whose system prompt begins with a fresh request id;
- routing (``rr-``, engines adv-rr-1 and adv-rr-2 behind the gateway's round robin): sessions spread
  over both instances turn by turn;
- capacity (``cap-``, engine adv-cap): six documents asked in turn on a cache with room for three;
- concurrency (``q-``, engine adv-q with --max-batch 1): short requests behind long generations; its
  steps all ran one sequence, so a larger batch cannot be priced and the advice says why;
- concurrency with its steps (``qb-``, engine adv-qb with --max-batch 2): short requests behind two
  long generations, so that decode steps of one and of two sequences are measured, and a larger batch
  is priced with the step time they give (extrapolated to three and four);
- cold starts (``cold-``, engine adv-cold with --lazy-load): the first request waits for the load, and
  after a restart a repeated prompt finds the cache emptied and waits again.

The same answer is read from the CLI (text and JSON, through the collector and from its stopped file),
the API, the advice page and the overview's Advice panel.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import uuid

import httpx
import polars as pl
import pytest
from harness_collector import CollectorProcess, wait_for
from harness_engine import EngineProcess
from harness_gateway import GatewayProcess

from tokentrace.analyzers.advise import fifo_waits, reusable_if_stable
from tokentrace.analyzers.step_model import batched_waits, fit_steps
from tokentrace.demo_workload import _words, chat, reply, stream_in_background

BLOCK = 16
SESSIONS, TURNS = 4, 3
#: The capacity part: six documents in turn, three times, on a cache with room for about three.
DOCS = [0, 1, 2, 3, 4, 5] * 3
#: The tiny model's KV bytes per token (2 x 2 layers x 2 KV heads x 16 dims x 4 bytes).
KV = 512
CAP_BYTES = KV * 1100
LONG, ROUNDS, SHORT = 400, 2, 3
#: The batched part's short answers (long enough that their decode shares steps with the long ones).
SHORT_TOKENS = 8


def _cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "tokentrace", *args], capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def _system(seed: int) -> dict:
    """A system prompt that begins with a fresh request id (the lever), then the same instructions."""
    return {"role": "system", "content": f"Request {uuid.uuid4().hex}. " + _words(100 + seed, 60)}


def _context(url: str) -> None:
    for s in range(SESSIONS):
        messages = [{"role": "user", "content": _words(200 + s, 30)}]
        for turn in range(TURNS):
            answer = chat(url, f"ctx-{s}-{turn}", [_system(s), *messages], 4, session=f"ctx-{s}")
            messages += [reply(answer), {"role": "user", "content": _words(300 + 10 * s + turn, 12)}]


def _routing(gateway: GatewayProcess) -> None:
    for s in range(SESSIONS):
        messages = [{"role": "system", "content": _words(400 + s, 60)},
                    {"role": "user", "content": _words(500 + s, 20)}]
        for turn in range(TURNS):
            seen = gateway.chat(messages, f"rr-{s}-{turn}", session=f"rr-{s}", max_tokens=4, ignore_eos=True)
            assert seen["status"] == 200, seen
            messages += [{"role": "assistant", "content": seen["text"]},
                         {"role": "user", "content": _words(600 + 10 * s + turn, 12)}]


def _capacity(url: str) -> None:
    for i, doc in enumerate(DOCS):
        chat(url, f"cap-{i}", [{"role": "user", "content": "document " + _words(700 + doc, 90)}], 1)


def _concurrency(url: str) -> None:
    """Each round: a long generation holds the only slot (its first token arrived), then short
    requests arrive together and queue behind it."""
    for r in range(ROUNDS):
        thread, first = stream_in_background(url, f"q-long-{r}", [{"role": "user", "content": _words(800 + r, 10)}],
                                             LONG)
        assert first.wait(120)
        shorts = [threading.Thread(target=chat, args=(url, f"q-short-{r}-{k}",
                                                      [{"role": "user", "content": _words(900 + 10 * r + k, 8)}], 2))
                  for k in range(SHORT)]
        for short in shorts:
            short.start()
        for short in [*shorts, thread]:
            short.join(300)


def _batched(url: str) -> None:
    """Each round on two slots: a long generation, then one half as long beside it (both decoding:
    steps of two sequences), then short requests that queue behind them; the long one ends alone
    (steps of one sequence)."""
    for r in range(ROUNDS):
        streams = []
        for k, tokens in enumerate((LONG, LONG // 2)):
            thread, first = stream_in_background(url, f"qb-long-{r}-{k}",
                                                 [{"role": "user", "content": _words(1100 + 10 * r + k, 10)}], tokens)
            assert first.wait(120)
            streams.append(thread)
        shorts = [threading.Thread(target=chat, args=(url, f"qb-short-{r}-{k}", [
            {"role": "user", "content": _words(1200 + 10 * r + k, 8)}], SHORT_TOKENS)) for k in range(SHORT)]
        for short in shorts:
            short.start()
        for thread in [*shorts, *streams]:
            thread.join(300)


def _cold(engine: EngineProcess) -> None:
    """Two requests on a lazily loading engine, a restart, then the second prompt again."""
    document = [{"role": "user", "content": "document " + _words(990, 60)}]
    chat(engine.url, "cold-0", [{"role": "user", "content": _words(991, 8)}], 2)
    chat(engine.url, "cold-1", document, 2)
    assert engine.stop() == 0, engine.log_path.read_text()
    engine.start(ready=False)  # the same instance, port and flags: a restart
    chat(engine.url, "cold-2", document, 2)


@pytest.fixture(scope="module")
def advised(tmp_path_factory, tiny_model):
    workdir = tmp_path_factory.mktemp("advise")
    spool = workdir / "spool"
    collector = CollectorProcess(workdir, "--spool-dir", str(spool)).start()
    beat = ["--heartbeat-interval", "0.5"]
    flags = {"adv-ctx": beat, "adv-rr-1": beat, "adv-rr-2": beat,
             "adv-cap": [*beat, "--cache-max-entries", "1000", "--cache-max-bytes", str(CAP_BYTES)],
             "adv-q": [*beat, "--max-batch", "1"], "adv-qb": [*beat, "--max-batch", "2"],
             "adv-cold": [*beat, "--lazy-load"]}
    engines = {name: EngineProcess(workdir, tiny_model, *args, collector=collector, spool_dir=spool, instance_id=name)
               for name, args in flags.items()}
    gateway = None
    try:
        for name, engine in engines.items():
            engine.start(ready=name != "adv-cold")  # a lazy engine is not ready before its first request
        gateway = GatewayProcess(workdir, {name: engines[name].url for name in ("adv-rr-1", "adv-rr-2")},
                                 "--route", "round_robin", collector=collector).start()
        _context(engines["adv-ctx"].url)
        _routing(gateway)
        _capacity(engines["adv-cap"].url)
        _concurrency(engines["adv-q"].url)
        _batched(engines["adv-qb"].url)
        _cold(engines["adv-cold"])
    finally:
        if gateway is not None:
            assert gateway.stop() == 0, gateway.log_path.read_text()
        for engine in engines.values():
            assert engine.stop() == 0, engine.log_path.read_text()
    wait_for(lambda: not list(spool.glob("*.pb*")), 120, "the collector to ingest the spool")
    # The rows the independent computations use, and the advice from the stopped collector's file;
    # then the collector serves the same file again.
    assert collector.stop() == 0
    collector.rows = {prefix: _rows(collector, prefix) for prefix in ("ctx-", "rr-", "cap-", "q-", "qb-", "cold-")}
    collector.steps = _steps(collector, "adv-qb", collector.rows["qb-"])
    [(collector.cap_free,)] = collector.sql("SELECT arg_max(memory_free_bytes, t_ns) FROM heartbeats "
                                            "WHERE instance_id = 'adv-cap'")
    collector.from_file = json.loads(_cli("analyze", "advise", "--db", str(collector.db), "--since", "all",
                                          "--request-prefix", "cap-", "--json").stdout)
    collector.start()
    yield collector
    collector.stop()


def _advice(collector: CollectorProcess, **params) -> dict:
    response = httpx.get(f"{collector.url}/api/advice", params={"since": "all", **params}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def _kind(result: dict, kind: str, instance: str | None = None) -> dict:
    found = [a for a in result["advice"] if a["kind"] == kind and (instance is None or a["instance_id"] == instance)]
    assert found, (kind, instance, result["nothing"], [(a["kind"], a["instance_id"]) for a in result["advice"]])
    return found[0]


def _rows(collector: CollectorProcess, prefix: str) -> list[dict]:
    rows = collector.sql(
        "SELECT request_id, instance_id, start_ns, end_ns, prompt_tokens, cached_tokens, completion_tokens, "
        "queue_ms, prefill_ms, load_wait_ms, tpot_ms, decode_ms FROM requests WHERE starts_with(request_id, ?) "
        "AND observer IS DISTINCT FROM 'gateway' ORDER BY start_ns", [prefix])
    names = ("request_id", "instance_id", "start_ns", "end_ns", "prompt_tokens", "cached_tokens", "completion_tokens",
             "queue_ms", "prefill_ms", "load_wait_ms", "tpot_ms", "decode_ms")
    return [dict(zip(names, row, strict=True)) for row in rows]


def _steps(collector: CollectorProcess, instance: str, rows: list[dict]) -> list[dict]:
    """The instance's engine steps over its requests' span, as stored."""
    found = collector.sql(
        "SELECT duration_ns, prefill_seqs, decode_seqs, decode_request_ids FROM steps WHERE instance_id = ? "
        "AND start_ns >= ? AND start_ns <= ? ORDER BY start_ns",
        [instance, min(r["start_ns"] for r in rows), max(r["end_ns"] for r in rows)])
    return [dict(zip(("duration_ns", "prefill_seqs", "decode_seqs", "decode_request_ids"), row, strict=True))
            for row in found]


def _rate(rows: list[dict]) -> float:
    """Prefill tokens per second, computed here: uncached prompt tokens over prefill time."""
    done = [r for r in rows if (r["prefill_ms"] or 0) > 0 and r["prompt_tokens"] - (r["cached_tokens"] or 0) > 0]
    return sum(r["prompt_tokens"] - (r["cached_tokens"] or 0) for r in done) / sum(r["prefill_ms"] for r in done) * 1e3


def _close(figure: float, expected: float, share: float = 0.10) -> bool:
    return abs(figure - expected) <= share * abs(expected)


# --- by hand ---------------------------------------------------------------------------------------
def test_what_a_stable_segment_would_have_reused_is_counted_up_to_the_next_difference():
    def seg(role, h, start, end):
        return {"role": role, "hash": h, "token_start": start, "token_end": end}

    earlier = [seg("system", 1, 0, 40), seg("user", 2, 40, 70)]
    # the system message changed (the lever), the user message is the same, then the prompt goes on
    ours = [seg("system", 9, 0, 41), seg("user", 2, 41, 71), seg("assistant", 3, 71, 80), seg("user", 4, 80, 99)]
    assert reusable_if_stable(ours, earlier, 16, 99) == 64  # through the shared user message, whole blocks
    # a second difference ends it: only the forgiven segment counts
    # (the system message alone: 41 tokens, 2 whole blocks)
    assert reusable_if_stable(ours, [seg("system", 1, 0, 40), seg("user", 5, 40, 70)], 16, 99) == 32
    assert reusable_if_stable(ours, earlier, 16, 20) == 19  # at most the prompt less one token


def test_the_slot_model_is_first_come_first_served():
    # one slot: the second waits for the first, the third for both
    assert fifo_waits([0, 1, 2], [10, 5, 5], 1) == [0, 9, 13]
    assert fifo_waits([0, 1, 2], [10, 5, 5], 2) == [0, 0, 4]
    # two instances of one slot: the second goes to the empty one; the third finds one request in
    # each and goes to the first (ties: the lowest index), not to the one that frees first
    assert fifo_waits([0, 1, 2], [10, 5, 5], 1, 2) == [0, 0, 8]


def test_the_batched_slot_model_slows_decoding_by_the_step_time_of_its_batch():
    # flat steps: the first-come-first-served model itself
    assert batched_waits([0, 1, 2], [4, 0, 5], [6, 5, 0], [1, 1, 1], 1, lambda k: 1.0) == \
        fifo_waits([0, 1, 2], [10, 5, 5], 1)
    # a step of k sequences takes k ms: two decoding together take twice as long, the third waits
    assert batched_waits([0, 0, 0], [0, 0, 0], [10, 10, 10], [1, 1, 1], 2, lambda k: k) == [0, 0, 20]
    # a request measured at steps of 2 ms runs faster alone, at steps of 1 ms
    assert batched_waits([0, 0], [0, 0], [10, 10], [2, 2], 1, lambda k: k) == [0, 5]


def test_the_step_fit_rests_on_decode_steps_and_needs_two_sizes():
    def steps(rows):
        return pl.DataFrame(rows, schema=["duration_ns", "prefill_seqs", "decode_seqs"], orient="row")

    model, why = fit_steps(steps([(1_000_000, 0, 1), (1_200_000, 0, 1), (3_000_000, 0, 2), (9_000_000, 1, 2)]))
    assert why is None and model.as_dict(4)["sizes"] == [{"decode_seqs": 1, "steps": 2, "median_ms": 1.1},
                                                          {"decode_seqs": 2, "steps": 1, "median_ms": 3.0}]
    assert abs(model.ms(1) - 1.1) < 1e-9 and abs(model.ms(2) - 3.0) < 1e-9 and model.as_dict(4)["extrapolated"]
    model, why = fit_steps(steps([(3_000_000, 0, 1), (1_000_000, 0, 2)]))
    assert model.flattened and model.per_sequence_ms == 0 and model.ms(4) == 2.0
    model, why = fit_steps(steps([(1_000_000, 0, 1), (5_000_000, 1, 2)]))
    assert model is None and "all ran 1 sequence" in why


# --- the built workload ---------------------------------------------------------------------------
def test_context_advice_names_the_system_message_and_prices_what_it_cost(advised):
    result = _advice(advised, request_prefix="ctx-")
    advice = _kind(result, "context")
    best = advice["changes"][0]
    assert (best["segment_role"], best["segment_index"]) == ("system", 0), best
    assert best["requests"] == SESSIONS * (TURNS - 1)
    rows = {r["request_id"]: r for r in advised.rows["ctx-"]}
    # Independently: each follow-up would have reused its previous turn's prompt, in whole blocks.
    lost = sum(rows[f"ctx-{s}-{t - 1}"]["prompt_tokens"] // BLOCK * BLOCK - (rows[f"ctx-{s}-{t}"]["cached_tokens"] or 0)
               for s in range(SESSIONS) for t in range(1, TURNS))
    assert lost > 0 and _close(best["prefill_tokens"], lost), (best["prefill_tokens"], lost)
    rate = _rate(list(rows.values()))
    assert _close(best["saved_ms"], lost / rate * 1e3), (best["saved_ms"], lost / rate * 1e3)
    assert set(best["request_ids"]) == {f"ctx-{s}-{t}" for s in range(SESSIONS) for t in range(1, TURNS)}
    assert result["nothing"]["routing"].startswith("one instance")


def test_routing_advice_replays_sticky_sessions_against_round_robin(advised):
    result = _advice(advised, request_prefix="rr-")
    advice = _kind(result, "routing")
    best = advice["changes"][0]
    assert best["route"] in ("session", "prefix"), advice["changes"]
    assert "round_robin" not in [c["route"] for c in advice["changes"]]  # the current policy is not advised
    assert advice["requests"] >= SESSIONS  # the instance changes it rests on
    assert any(e["kind"] == "instance_change" for e in advice["evidence"])
    rows = {r["request_id"]: r for r in advised.rows["rr-"]}
    # Independently: sticky sessions reuse each previous turn's prompt (whole blocks); the recorded
    # placement reused what the engines reported.
    sticky = sum(rows[f"rr-{s}-{t - 1}"]["prompt_tokens"] // BLOCK * BLOCK
                 for s in range(SESSIONS) for t in range(1, TURNS))
    recorded = sum(r["cached_tokens"] or 0 for r in rows.values())
    assert sticky - recorded > 0 and _close(best["prefill_tokens"], sticky - recorded), \
        (best["prefill_tokens"], sticky, recorded)


def test_capacity_advice_sizes_the_cache_that_keeps_the_working_set(advised):
    result = _advice(advised, request_prefix="cap-")
    advice = _kind(result, "capacity", "adv-cap")
    best = advice["changes"][0]
    rows = advised.rows["cap-"]
    # Independently: the six documents' entries (prompt + answer) are the working set, and with room
    # for them every repeat reuses its document's prompt in whole blocks, less what the engine did.
    first = {DOCS[i]: r for i, r in enumerate(rows) if DOCS.index(DOCS[i]) == i}
    working = sum(r["prompt_tokens"] + r["completion_tokens"] for r in first.values())
    assert best["capacity_tokens"] >= working > CAP_BYTES // KV, (best["capacity_tokens"], working)
    gain = sum(min(r["prompt_tokens"] // BLOCK * BLOCK, r["prompt_tokens"] - 1) for r in rows[len(first):]) \
        - sum(r["cached_tokens"] or 0 for r in rows)
    assert gain > 0 and _close(best["prefill_tokens"], gain), (best["prefill_tokens"], gain)
    assert advice["requests"] > 0 and all(rid.startswith("cap-") for rid in advice["request_ids"])
    assert best["extra_kv_bytes"] == (best["capacity_tokens"] - CAP_BYTES // KV) * KV
    # Whether memory allows it: against the free memory the engine's latest heartbeat reported.
    free = advised.cap_free
    assert free and best["memory_free_bytes"] == free, (best, free)
    assert best["fits"] is (best["extra_kv_bytes"] <= free) and best["nodes"] is None
    memory = next(e for e in advice["evidence"] if e["kind"] == "memory")
    assert memory["fits"] is best["fits"] and "free" in memory["text"] and "operator" not in memory["text"], memory


def test_concurrency_advice_models_the_queue_it_measured(advised):
    result = _advice(advised, request_prefix="q-", slo="first_token=20ms")
    advice = _kind(result, "concurrency", "adv-q")
    model = next(e for e in advice["evidence"] if e["kind"] == "queue_model")
    rows = advised.rows["q-"]
    measured = sum(r["queue_ms"] for r in rows)
    assert model["batch_limit"] == 1 and _close(model["measured_wait_ms"], measured, 0.001)
    # The model at the current limit reproduces the waiting that was measured.
    assert _close(model["model_wait_ms"], measured), (model, measured)
    # The long generations held the slot longest while others waited (a short one held it a little).
    blockers = [e["request_id"] for e in advice["evidence"] if e["kind"] == "blocker"]
    assert set(blockers[:ROUNDS]) == {f"q-long-{r}" for r in range(ROUNDS)}, blockers
    # Its steps all ran one sequence: how much slower a step of two runs was not measured, and the
    # larger batch says so instead of a saving.
    larger = [c for c in advice["changes"] if c.get("batch_limit")]
    assert [c["batch_limit"] for c in larger] == [2], advice["changes"]
    assert larger[0]["saved_ms"] is None and larger[0]["step_model"] is None, larger
    assert "decode steps in the window all ran 1 sequence" in larger[0]["why_not"], larger
    best = advice["changes"][0]
    assert best.get("instances") == 2, advice["changes"]
    # Independently: the same requests over two instances of one slot, each arrival to the one with
    # fewer requests in it (ties: the first), computed here.
    arrivals = [(r["start_ns"] - rows[0]["start_ns"]) / 1e6 + (r["load_wait_ms"] or 0) for r in rows]
    holds = [max(0.0, (r["end_ns"] - r["start_ns"]) / 1e6 - (r["load_wait_ms"] or 0) - r["queue_ms"]) for r in rows]
    free, inside, waits = [0.0, 0.0], [[], []], []
    for a, h in zip(arrivals, holds, strict=True):
        inside = [[end for end in ends if end > a] for ends in inside]
        k = min(range(2), key=lambda i: (len(inside[i]), i))
        start = max(a, free[k])
        waits.append(start - a)
        free[k] = start + h
        inside[k].append(start + h)
    assert _close(best["saved_ms"], model["model_wait_ms"] - sum(waits)), (best, sum(waits))
    assert best["saved_ms"] > 0
    # The objective it misses points at this lever.
    objectives = _kind(result, "objectives")
    assert objectives["changes"][0]["lever"] == "concurrency" and result["advice"][-1]["kind"] == "objectives"


def _ticked(arrivals: list[float], fixed: list[float], decode: list[float], measured: list[float], slots: int,
            step_ms, tick: float = 0.02) -> list[float]:
    """Waits in a slot model advanced in small ticks (an independent way to the advice's): first come
    first served; a request holds its slot for its fixed part, then its decode part, made at steps of
    ``measured`` ms, advances by tick * measured / step_ms(k) while k requests decode."""
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i])
    waits, queue, active, now, k = [0.0] * len(arrivals), [], {}, 0.0, 0
    while k < len(order) or queue or active:
        if not queue and not active:
            now = max(now, arrivals[order[k]])
        while k < len(order) and arrivals[order[k]] <= now:
            queue.append(order[k])
            k += 1
        while queue and len(active) < slots:
            i = queue.pop(0)
            waits[i] = now - arrivals[i]
            active[i] = [fixed[i], decode[i]]
        decoding = sum(1 for left in active.values() if left[0] <= 0)
        for i, left in list(active.items()):
            if left[0] > 0:
                left[0] -= tick
            else:
                left[1] -= tick * measured[i] / step_ms(decoding)
            if left[0] <= 0 and left[1] <= 0:
                del active[i]
        now += tick
    return waits


def test_a_larger_batch_is_priced_with_the_step_time_the_instances_own_steps_give(advised):
    result = _advice(advised, request_prefix="qb-")
    advice = _kind(result, "concurrency", "adv-qb")
    rows, steps = advised.rows["qb-"], advised.steps
    model = next(e for e in advice["evidence"] if e["kind"] == "queue_model")
    assert model["batch_limit"] == 2
    # Independently, from the stored steps: the decode steps (decoding, none prefilling) per batch
    # size, and the line through the two sizes' medians (flat if it falls: noise).
    sizes: dict[int, list[float]] = {}
    for step in steps:
        if (step["decode_seqs"] or 0) >= 1 and not step["prefill_seqs"]:
            sizes.setdefault(step["decode_seqs"], []).append(step["duration_ns"] / 1e6)
    assert set(sizes) == {1, 2}, {n: len(v) for n, v in sizes.items()}
    medians = {n: statistics.median(v) for n, v in sizes.items()}
    slope = medians[2] - medians[1]
    if slope < 0:
        level = sum(medians[n] * len(sizes[n]) for n in sizes) / sum(len(v) for v in sizes.values())
        slope, medians = 0.0, {1: level, 2: level}

    def step_ms(n: float) -> float:
        return medians[1] + slope * (n - 1)

    # Each request's measured step: the fit at the mean batch of the steps that name it decoding.
    named: dict[str, list[int]] = {}
    for step in steps:
        if (step["decode_seqs"] or 0) >= 1:
            for rid in step["decode_request_ids"] or []:
                named.setdefault(rid, []).append(step["decode_seqs"])
    assert all(r["request_id"] in named for r in rows), set(r["request_id"] for r in rows) - set(named)
    measured = [step_ms(statistics.fmean(named[r["request_id"]])) for r in rows]
    arrivals = [(r["start_ns"] - rows[0]["start_ns"]) / 1e6 + (r["load_wait_ms"] or 0) for r in rows]
    holds = [max(0.0, (r["end_ns"] - r["start_ns"]) / 1e6 - (r["load_wait_ms"] or 0) - r["queue_ms"]) for r in rows]
    decode = [min(h, r["decode_ms"] or 0.0) for h, r in zip(holds, rows, strict=True)]
    fixed = [h - d for h, d in zip(holds, decode, strict=True)]
    now = sum(_ticked(arrivals, fixed, decode, [1.0] * len(rows), 2, lambda n: 1.0))
    assert _close(model["model_wait_ms"], now), (model, now)
    text = _cli("analyze", "advise", "--url", advised.url, "--since", "all", "--request-prefix", "qb-").stdout
    for limit in (3, 4):
        change = next(c for c in advice["changes"] if c.get("batch_limit") == limit)
        fit = change["step_model"]
        # (a) the step model and what it rests on: how many steps at which sizes, extrapolated past 2
        assert [(s["decode_seqs"], s["steps"]) for s in fit["sizes"]] == [(1, len(sizes[1])), (2, len(sizes[2]))]
        for size in fit["sizes"]:
            assert _close(size["median_ms"], statistics.median(sizes[size["decode_seqs"]]), 0.001), fit
        assert fit["range"] == [1, 2] and fit["at"] == limit and fit["extrapolated"] is True, fit
        assert _close(fit["step_ms_at"], step_ms(limit)), (fit, step_ms(limit))
        assert "extrapolated beyond the 2 it measured" in change["change"] and change["change"] in text
        # (b) the saving: the model's wait now less the wait with the limit raised and each decode
        # slowed (or sped) to the step time of the batch it then decodes in, computed here
        expected = now - sum(_ticked(arrivals, fixed, decode, measured, limit, step_ms))
        assert expected > 0 and _close(change["saved_ms"], expected), (change, expected)


def test_cold_start_advice_prices_the_lazy_loads_and_the_restart(advised):
    result = _advice(advised, request_prefix="cold-")
    advice = _kind(result, "cold_start", "adv-cold")
    changes = {("restart" if "restarting" in c["change"] else "ready"): c for c in advice["changes"]}
    rows = {r["request_id"]: r for r in advised.rows["cold-"]}
    # Independently: the two requests that arrived at a loading engine waited this long in all.
    waited = [r for r in rows.values() if (r["load_wait_ms"] or 0) > 0]
    assert {r["request_id"] for r in waited} == {"cold-0", "cold-2"}, waited
    ready = changes["ready"]
    assert "before it takes traffic" in ready["change"] and ready["requests"] == 2
    assert _close(ready["saved_ms"], sum(r["load_wait_ms"] for r in waited)), (ready, waited)
    # The restart emptied the cache that held cold-1's prompt: cold-2 recomputed it.
    restart = changes["restart"]
    assert restart["requests"] == 1 and restart["process_starts"] == 2
    expected = rows["cold-1"]["prompt_tokens"] // BLOCK * BLOCK
    assert _close(restart["prefill_tokens"], expected), (restart, expected)
    assert "cold-2" in advice["request_ids"]
    assert not any("keep-alive" in c["change"] for c in advice["changes"])  # nothing unloaded when idle


def test_the_whole_workload_ranks_each_levers_change_first_on_every_surface(advised, tmp_path):
    result = _advice(advised)
    assert _kind(result, "context")["changes"][0]["segment_role"] == "system"
    assert _kind(result, "routing")["changes"][0]["route"] in ("session", "prefix")
    assert _kind(result, "capacity")["instance_id"] == "adv-cap"
    assert _kind(result, "concurrency", "adv-q") and _kind(result, "concurrency", "adv-qb")
    savings = [a["saved_ms"] for a in result["advice"] if a["saved_ms"] is not None]
    assert savings == sorted(savings, reverse=True)  # ranked by what they would save
    # The command line says the same, as JSON and as text.
    cli = json.loads(_cli("analyze", "advise", "--url", advised.url, "--since", "all", "--json").stdout)
    assert [(a["kind"], a["instance_id"], a["changes"][0]["change"]) for a in cli["advice"]] == \
        [(a["kind"], a["instance_id"], a["changes"][0]["change"]) for a in result["advice"]]
    text = _cli("analyze", "advise", "--url", advised.url, "--since", "all").stdout
    assert text.startswith("Advice over ") and "1. " in text
    for item in result["advice"]:
        assert item["changes"][0]["change"] in text
    # The advice page and its twin; request ids are links.
    page = httpx.get(f"{advised.url}/advice.json", params={"since": "all"}, timeout=300).json()
    assert [a["changes"][0]["change"] for a in page["advice"]["advice"]] == \
        [a["changes"][0]["change"] for a in result["advice"]]
    html = httpx.get(f"{advised.url}/advice", params={"since": "all"}, timeout=300).text
    assert 'href="/requests/ctx-1-1"' in html and "data-kind=\"context\"" in html
    overview = httpx.get(f"{advised.url}/.json", params={"since": "all"}, timeout=300).json()
    assert overview["advice"]["advice"], overview["advice"]
    assert 'id="advice"' in httpx.get(f"{advised.url}/", params={"since": "all"}, timeout=300).text


def test_a_stopped_collectors_file_gives_the_same_advice(advised):
    through = _advice(advised, request_prefix="cap-")
    assert advised.from_file["advice"] == through["advice"] and through["advice"]


@pytest.mark.parametrize("args, message", [
    (["--verdicts", "-1"], "--verdicts must be 0 or more"),
    (["--since", "soon"], "--since must be a duration"),
    (["--since", "1h", "--from", "2026-12-05T00:00:00Z"], "not both"),
])
def test_bad_advise_options_exit_2_with_a_clear_message(args, message):
    result = _cli("analyze", "advise", "--db", "/nonexistent.duckdb", *args, check=False)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_advice_page_and_overview_panel_in_a_browser(advised, browser_page):
    """The page a user reads: each kind in rank order with its change, saving and evidence; request
    ids are links that open the request's page; the overview's panel shows the best changes."""
    result = _advice(advised)
    browser_page.open(f"{advised.url}/advice?since=all")
    page = browser_page.page
    sections = page.locator("section.advice")
    assert sections.count() == len(result["advice"])
    for k, item in enumerate(result["advice"]):
        section = sections.nth(k)
        assert section.get_attribute("data-kind") == item["kind"]
        assert item["changes"][0]["change"] in section.inner_text()
    browser_page.screenshot("advice")
    page.locator('section.advice[data-kind="capacity"] a.request-link').first.click()
    page.wait_for_url("**/requests/cap-*")
    assert "cap-" in page.locator("h1").inner_text()
    browser_page.screenshot("advice-request")
    browser_page.open(f"{advised.url}/timeline?since=all")
    browser_page.screenshot("advice-timeline")
    browser_page.open(f"{advised.url}/?since=all")
    panel = page.locator("#advice")
    assert result["advice"][0]["changes"][0]["change"] in panel.inner_text()
    browser_page.screenshot("overview-advice")
    browser_page.assert_clean()
