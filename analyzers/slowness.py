"""Slowness verdict: where did this request's time go, and is that out of line for its instance?

Definitions (the contract; tests check them):
- ``outcome``: completed | rejected | failed | cancelled (``outcome.outcome_of``). Only a completed
  request gets a category; the others get ``category`` None and an ``outcome`` evidence item.
- ``breakdown_ms``: load_wait, queue, prefill, decode, other (= e2e - the four), ttft, first_content,
  tpot, e2e; a part the observer did not measure is None (never 0), and ``other`` is None unless all
  four are known. Two TTFTs, both named: ``ttft`` is the time to first *token* (the engine's: arrival
  to the first token generated; the phases add up to it), ``first_content`` the time to first
  *content* (the client's: arrival to the first response chunk carrying answer text, what aiperf or
  a browser measures as TTFT).
- ``category``: the largest of load_wait -> cold_start, queue -> queueing, prefill -> prefill,
  decode -> decode; ties go to the earlier one in that order. A part that cannot be the largest
  does not block naming the largest: an unknown part is at most what the known parts leave of the
  e2e (and of TTFT, for load_wait, queue and prefill; ``outcome.unknown_bounds``); when the largest
  known part is larger than every unknown part's bound it is the category, and a ``bounded``
  evidence item gives the bounds ("load_wait not measured by this observer; at most 16.4 ms").
  Only when an unknown part could still be the largest is the request ``undecomposed``, and its
  ``undecomposed`` item names the observer that could have measured it. With all four known, a
  request whose ``other`` (time in no phase) is larger than its largest part is ``undecomposed``
  too, and its item says how much was in no phase (``outcome.unattributed``). ``ttft_category``: the
  same over load_wait, queue and prefill.
- ``abnormal``: the category's component against the instance's own baseline, the median over
  comparable recent requests (same instance, the 30 minutes before, at most 200, successful, not
  cold): load_wait and queue in ms, prefill as ms per uncached token (comparable: uncached tokens
  within 4x), decode as TPOT. Abnormal when observed > factor x baseline + floor (table below);
  None when fewer than 3 comparable requests exist.
- ``evidence`` per category: cold_start -> the load and its dominant stage; queueing -> queue depth
  at arrival and the requests that held batch slots during the wait; prefill -> uncached and cached
  tokens, prefill rate vs baseline, the cache verdict; decode -> TPOT vs baseline, batch size over the
  decode, steps shared with other requests' prefill chunks (named), context length.

``load_slow_facts`` reads through the reader role (``rows``: no frames, so that ``analyze slow --db``
imports no polars or pyarrow); ``classify_slowness`` is a pure function of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokentrace import contract as c
from tokentrace.analyzers.cache import CacheVerdict, analyze_cache, request_window
from tokentrace.analyzers.evidence import Evidence, fmt_ms, median, ms, plural
from tokentrace.analyzers.live import Stall, not_found, stall_of
from tokentrace.analyzers.outcome import (
    COMPLETED,
    PHASES,
    UNDECOMPOSED,
    known_parts,
    largest_part,
    measures_of,
    outcome_of,
    unknown_bounds,
)
from tokentrace.analyzers.roofline import load_hardware, memory_bandwidth
from tokentrace.analyzers.slo import SloSpec, missed_objectives
from tokentrace.analyzers.upstream import upstream_evidence
from tokentrace.collector.stores.store import TraceReader

#: The error codes of a request a distributed engine failed because its ring stopped moving
#: (engine_shim/mlx/cluster.py LocalRanks.diagnose), and what each says of the rank.
STALL_STATES = {
    "RankStopped": "is alive but not stepping: its process is stopped (SIGSTOP, a debugger) or its host hangs",
    "RankLost": "is gone: its process exited",
    "RankUnresponsive": "did not complete its part of the step, its process alive",
}
STALL_LOOKBACK_NS = 60 * 1_000_000_000

CATEGORIES = (("load_wait", "cold_start"), ("queue", "queueing"), ("prefill", "prefill"), ("decode", "decode"))
#: (factor, floor) of the abnormal test per component; floors keep sub-noise differences normal.
THRESHOLDS = {"load_wait": (2.0, 25.0), "queue": (2.0, 25.0), "prefill": (2.0, 25.0), "decode": (1.5, 1.0)}
BASELINE_WINDOW_NS = 30 * 60 * 1_000_000_000
BASELINE_LIMIT = 200
MIN_SAMPLES = 3
#: Which observers measure a phase, for a verdict that lacks it (docs/gateway.md, docs/vllm.md).
MEASURED_BY = {
    "load_wait": "an observer inside the engine (the tokentrace engine, vLLM with the tokentrace plugin) or "
                 "the gateway in front of an engine that reports its loads (Ollama)",
    "queue": "an observer inside the engine (the tokentrace engine, vLLM with the tokentrace plugin); the "
             "gateway measures only its own wait",
    "prefill": "an observer inside the engine (the tokentrace engine, vLLM with the tokentrace plugin) or the "
               "gateway in front of an engine that reports its prompt time (llama.cpp, Ollama, LM Studio)",
    "decode": "the gateway on a streamed answer, or an observer inside the engine",
}


@dataclass
class SlowVerdict:
    """The slowness verdict of one request (schema in the module docstring)."""

    request_id: str
    instance_id: str | None
    engine: str | None
    outcome: str  #: completed | rejected | failed | cancelled
    breakdown_ms: dict[str, float | None]  #: None where the part is unknown
    category: str | None  #: cold_start | queueing | prefill | decode | undecomposed; None unless completed
    ttft_category: str | None  #: cold_start | queueing | prefill | undecomposed; None unless completed
    abnormal: bool | None  #: None when the baseline has too few comparable requests
    baseline: dict[str, Any]  #: {metric, unit, observed, value, samples, factor, floor}
    tokens: dict[str, int | None]  #: prompt, cached, completion
    evidence: list[Evidence] = field(default_factory=list)
    #: objectives this request missed, [{slo, objective_ms, observed_ms}] (analyzers.slo); [] if none set
    slo_missed: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict (evidence flattened to {kind, text, ...})."""
        return {"slo_missed": self.slo_missed,
            "request_id": self.request_id, "instance_id": self.instance_id, "engine": self.engine,
            "outcome": self.outcome, "breakdown_ms": self.breakdown_ms, "category": self.category,
            "ttft_category": self.ttft_category,
            "abnormal": self.abnormal, "baseline": self.baseline, "tokens": self.tokens,
            "evidence": [e.as_dict() for e in self.evidence],
        }


@dataclass
class SlowFacts:
    """Everything the slowness verdict needs, read from the store."""

    request: dict  #: the requests row
    phases: list[dict]  #: the request's phase spans
    baseline: list[dict]  #: recent requests of the instance (baseline.sql)
    load: list[dict]  #: the model load waited on, one row per stage (empty unless cold)
    holders: list[dict]  #: requests holding batch slots during the queue wait
    steps: list[dict]  #: engine steps in which this request decoded
    cache: CacheVerdict | None  #: the cache verdict (for prefill evidence)
    measures: frozenset[str] | None = None  #: parts the instance's observer declares; None: undeclared
    hardware: dict | None = None  #: weight bytes, KV bytes per token, chip, declared peak (roofline.py)
    #: A distributed instance's timed steps of this request, per node (node_steps.sql); [] otherwise
    nodes: list[dict] = field(default_factory=list)
    #: A request failed by a stalled ring: each node's last heartbeat and step (node_liveness.sql),
    #: before the failure and in the STALL_LOOKBACK_NS after it
    liveness: list[dict] = field(default_factory=list)
    after: list[dict] = field(default_factory=list)
    #: Such a request's stall as its rank 0 last reported it while the request was open
    #: (stall_report.sql): (the heartbeat's time, the stall it reported); None when none was stored
    stall: tuple[int, Stall] | None = None


def load_slow_facts(reader: TraceReader, request_id: str) -> SlowFacts:
    """Read the facts of one request; NotFound when the store has no such request."""
    request = reader.request(request_id)
    if request is None:
        raise not_found(reader, request_id)
    request_id = request["request_id"]  # the request's own id, should an alias have been given
    instance, start = request["instance_id"], request["start_ns"]
    # Reads that do not depend on one another run together (TraceReader.together), in two rounds.
    declared, phases, baseline = reader.together(
        lambda: reader.rows("observers", instance_id=instance),
        lambda: reader.rows("phases", request_id=request_id, **request_window(request)),
        lambda: reader.rows("baseline", instance_id=instance, request_id=request_id,
                            since_ns=start - BASELINE_WINDOW_NS, before_ns=start, limit=BASELINE_LIMIT))
    measures = measures_of(declared[0]["attributes"]) if declared else None
    waits, decode = _named(phases, "llm.load_wait"), _named(phases, "llm.decode")
    window = _queue_window(request, phases)
    # Only a prefill verdict cites the cache verdict; it is the costliest fact to load.
    category = category_of(request, measures)
    prefill = category == "prefill"
    stalled = request.get("error_type") in STALL_STATES
    cache, load, holders, steps, hardware, nodes, liveness, after, reports = reader.together(
        lambda: analyze_cache(reader, request_id) if prefill else None,
        lambda: reader.rows("model_load", load_id=waits[0]["load_id"]) if waits and waits[0]["load_id"] else [],
        lambda: reader.rows("slot_holders", instance_id=instance, request_id=request_id,
                            t0_ns=window[0], t1_ns=window[1]) if window else [],
        lambda: reader.rows("decode_context", instance_id=instance, request_id=request_id,
                            t0_ns=decode[0]["start_ns"] - 1_000_000_000, t1_ns=decode[0]["end_ns"]) if decode else [],
        lambda: load_hardware(reader, instance, request["end_ns"]) if decode else None,
        lambda: reader.rows("node_steps", instance_id=instance, request_id=request_id, t0_ns=start,
                            t1_ns=request["end_ns"]),
        lambda: reader.rows("node_liveness", instance_id=instance, t0_ns=start - STALL_LOOKBACK_NS,
                            t1_ns=request["end_ns"]) if stalled else [],
        lambda: reader.rows("node_liveness", instance_id=instance, t0_ns=request["end_ns"] + 1,
                            t1_ns=request["end_ns"] + STALL_LOOKBACK_NS) if stalled else [],
        lambda: reader.rows("stall_report", instance_id=instance, t0_ns=start, t1_ns=request["end_ns"])
        if stalled else [])
    report = stall_of(reports[0]["attributes"]) if reports else None
    return SlowFacts(request, phases, baseline, load, holders, steps, cache, measures, hardware, nodes, liveness,
                     after, (reports[0]["t_ns"], report) if report is not None else None)


def e2e_of(request: dict) -> float:
    """A requests row's end-to-end time in ms (its span's start to end)."""
    return (request["end_ns"] - request["start_ns"]) / 1e6


def category_of(request: dict, measures: frozenset[str] | None = None,
                components: tuple[str, ...] = PHASES) -> str | None:
    """The largest of ``components`` in a requests row, ties to the earlier one, as its category:
    None unless the request completed, ``undecomposed`` when an unknown component could be the
    largest (``outcome.largest_part``)."""
    if outcome_of(request) != COMPLETED:
        return None
    top = largest_part(known_parts(request, measures), e2e_of(request), components)
    return UNDECOMPOSED if top is None else dict(CATEGORIES)[top]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _named(phases: list[dict], name: str) -> list[dict]:
    """The phase rows of one span name, in their order."""
    return [row for row in phases if row["name"] == name]


def _queue_window(request: dict, phases: list[dict]) -> tuple[int, int] | None:
    queue = _named(phases, "llm.queue")
    if queue:
        return queue[0]["start_ns"], queue[0]["end_ns"]
    if request.get("queue_ms"):
        start = request["start_ns"] + int((request.get("load_wait_ms") or 0) * 1e6)
        return start, start + int(request["queue_ms"] * 1e6)
    return None


def classify_slowness(facts: SlowFacts) -> SlowVerdict:
    """The verdict, by the definitions in the module docstring. Pure."""
    r = facts.request
    known = known_parts(r, facts.measures)
    parts = {name: known[name] for name, _ in CATEGORIES}
    e2e = e2e_of(r)
    whole = None not in parts.values()
    other = round(max(0.0, e2e - sum(parts.values())), 3) if whole else None
    breakdown = {**{k: None if v is None else round(v, 3) for k, v in parts.items()}, "other": other,
                 "ttft": known["ttft"], "first_content": _round(r.get("first_content_ms")), "tpot": known["tpot"],
                 "e2e": round(e2e, 3)}
    outcome = outcome_of(r)
    category = category_of(r, facts.measures)
    tokens = {"prompt": r.get("prompt_tokens"), "cached": r.get("cached_tokens"),
              "completion": r.get("completion_tokens")}
    top = next((name for name, label in CATEGORIES if label == category), None)
    if top is None:
        verdict = SlowVerdict(r["request_id"], r["instance_id"], r.get("engine"), outcome, breakdown, category,
                              category, None, {}, tokens)
        (_outcome if outcome != COMPLETED else _undecomposed)(verdict, facts)
        if outcome == COMPLETED and (breakdown["queue"] or 0) > 0:
            # The parts that are known still explain themselves: a gateway's queue is measured
            # even where the engine's prefill is not (docs/gateway.md).
            _queueing(verdict, facts)
        verdict.evidence.extend(upstream_evidence(r, "slow"))
        return verdict
    baseline = _baseline(top, r, facts.baseline)
    verdict = SlowVerdict(
        r["request_id"], r["instance_id"], r.get("engine"), outcome, breakdown, category,
        category_of(r, facts.measures, PHASES[:3]), baseline.pop("abnormal"), baseline, tokens,
    )
    {"load_wait": _cold_start, "queue": _queueing, "prefill": _prefill, "decode": _decode}[top](verdict, facts)
    if top in ("prefill", "decode") and facts.nodes:
        _cluster(verdict, facts, top)
    if not whole:
        _bounded(verdict, facts, known, top)
    verdict.evidence.extend(upstream_evidence(r, "slow"))
    return verdict


def _outcome(verdict: SlowVerdict, facts: SlowFacts) -> None:
    r = facts.request
    why = {"rejected": "The engine refused this request", "failed": "This request failed",
           "cancelled": "This request was cancelled"}[verdict.outcome]
    details = [f"HTTP {r['http_status']}" if r.get("http_status") is not None else None, r.get("error_type"),
               f"finish reason {r['finish_reason']}" if r.get("finish_reason") else None,
               "the client disconnected" if r.get("client_disconnected") else None]
    said = ", ".join(d for d in details if d)
    verdict.evidence.append(Evidence(
        "outcome", f"{why}" + (f" ({said})" if said else "") + "; it is left out of slowness categories, "
                   "latency percentiles and cache hit rates.",
        {"outcome": verdict.outcome, "http_status": r.get("http_status"), "error_type": r.get("error_type"),
         "finish_reason": r.get("finish_reason"), "client_disconnected": r.get("client_disconnected")},
    ))
    if r.get("error_type") in STALL_STATES:
        _stalled(verdict, facts)


def _stalled(verdict: SlowVerdict, facts: SlowFacts) -> None:
    """A request a distributed engine failed because its ring stopped moving: since when no node
    stepped (the data plane), and which node stopped reporting (the control plane: each rank's
    own heartbeats) — the rank that stalled the others, when one did. Rank 0's stall report, when
    it held this request open with the same state, says both before the stored steps can: the
    ring operation it waited on began its ``ms`` before the report (the step the stall held is
    stored only once the ring moves again, or the engine stops), and its diagnosis names the
    rank (the process rank 0 found stopped or gone, or the control connection gone silent)."""
    r, code = facts.request, facts.request["error_type"]
    end = r["end_ns"]
    nodes = {c.node_rank(verdict.instance_id, row["instance_id"]): row for row in facts.liveness}
    steps = [row["last_step_end_ns"] for row in nodes.values() if row["last_step_end_ns"] is not None]
    at, report = facts.stall or (None, None)
    if report is not None and (report.state != code or r["request_id"] not in report.held):
        report = None  # another stall's report, or one that did not hold this request
    if report is not None and report.ms is not None:
        steps.append(at - report.ms * 1_000_000)
    since = max(steps) if steps else None
    silent = sorted(rank for rank, row in nodes.items()
                    if since is not None and (row["last_heartbeat_ns"] or 0) < since)
    later = {c.node_rank(verdict.instance_id, row["instance_id"]) for row in facts.after if row["last_heartbeat_ns"]}
    if code == "RankLost" and len(silent) != 1 and later:
        # A rank lost fails the request at once, before any heartbeat could be missed: the ranks that
        # reported after the failure were alive; the one that never did again is the one lost.
        silent = sorted(rank for rank in nodes if rank not in later)
    named = report.ranks[0] if report is not None and len(report.ranks) == 1 else None
    stalled = named if named is not None else silent[0] if len(silent) == 1 else None
    beating = sorted(rank for rank in nodes
                     if rank not in silent and rank != stalled and nodes[rank]["last_heartbeat_ns"])
    parts = [f"Stalled: no rank of {verdict.instance_id} completed a step in the "
             f"{fmt_ms((end - since) / 1e6)} before this request failed" if since is not None else
             f"Stalled: {verdict.instance_id} stopped stepping"]
    if stalled is not None:
        heard = nodes.get(stalled, {}).get("last_heartbeat_ns")
        others = ", ".join(f"rank {rank}" for rank in beating)
        parts.append(f"rank {stalled} {STALL_STATES[code]}; its heartbeats stopped "
                     + (f"{fmt_ms((end - heard) / 1e6)} before the failure" if heard else "before the stall")
                     + (f", while {others} went on reporting" if beating else "")
                     + (f" (rank 0's diagnosis, {fmt_ms(report.ms)} into the stall: {report.reason})"
                        if named is not None and report.ms is not None and report.reason else ""))
    elif code == "RankUnresponsive":
        parts.append("every rank went on reporting (alive) but none stepped: a rank or a link of the ring is stuck")
    else:
        parts.append(f"a rank {STALL_STATES[code]} (the ranks' heartbeats do not single one out)")
    verdict.evidence.append(Evidence("stalled", "; ".join(parts) + ".", {
        "state": code, "rank": stalled, "since_ns": since, "silent_ranks": silent, "reporting_ranks": beating,
        "stalled_ms": round((end - since) / 1e6, 3) if since is not None else None,
        "named_by": None if stalled is None else "diagnosis" if named is not None else "heartbeats",
        "diagnosis": report.reason if report is not None else None}))


def _missing(verdict: SlowVerdict, facts: SlowFacts) -> tuple[dict[str, float], list[str], list[str]]:
    """The known phases {part: ms}, and the unknown ones: unmeasured (the observer declares it
    cannot measure them), unreported (it can, but this request's row lacks them)."""
    parts = {name: verdict.breakdown_ms[name] for name in PHASES}
    known = {name: value for name, value in parts.items() if value is not None}
    unmeasured = sorted(name for name in parts if facts.measures is not None and name not in facts.measures)
    unreported = sorted(name for name in parts if parts[name] is None and name not in unmeasured)
    return known, unmeasured, unreported


def _why_unknown(unmeasured: list[str], unreported: list[str], bounds: dict[str, float | None]) -> list[str]:
    """'load_wait not measured by this observer (at most 16.4 ms)', per unknown phase."""
    def at_most(name: str) -> str:
        return "" if bounds.get(name) is None else f" (at most {fmt_ms(bounds[name])})"
    return ([f"{name} not measured by this observer{at_most(name)}" for name in unmeasured]
            + [f"{name} not reported for this request{at_most(name)}" for name in unreported])


def _bounded(verdict: SlowVerdict, facts: SlowFacts, known: dict[str, float | None], top: str) -> None:
    """Why the unknown phases of a named category cannot be the largest: their bounds."""
    _, unmeasured, unreported = _missing(verdict, facts)
    bounds = unknown_bounds(known, e2e_of(facts.request))
    ttft = verdict.breakdown_ms["ttft"]
    leave = f"the {fmt_ms(verdict.breakdown_ms['e2e'])} end-to-end" + (
        f" and the {fmt_ms(ttft)} time to first token" if ttft is not None else "")
    verdict.evidence.append(Evidence(
        "bounded", f"{'; '.join(_why_unknown(unmeasured, unreported, bounds))}: what the known parts leave of "
                   f"{leave}, less than {top}'s {fmt_ms(verdict.breakdown_ms[top])}, so {top} is the largest part.",
        {"at_most_ms": bounds, "unmeasured": unmeasured, "unreported": unreported, "largest": top,
         "largest_ms": verdict.breakdown_ms[top],
         "measures": None if facts.measures is None else sorted(facts.measures)},
        basis="inferred",
    ))


def _undecomposed(verdict: SlowVerdict, facts: SlowFacts) -> None:
    known, unmeasured, unreported = _missing(verdict, facts)
    other = verdict.breakdown_ms["other"]
    if other is not None and known:
        # Every phase known (``other`` is None otherwise), and more time in none of them than in the
        # largest (outcome.unattributed): naming the largest would say where a minority of it went.
        said = ", ".join(f"{name} {fmt_ms(value)}" for name, value in known.items())
        top = max(known, key=known.get)  # in PHASES order: ties to the earlier, as largest_part
        verdict.evidence.append(Evidence(
            "undecomposed", f"Known: {said}; {fmt_ms(other)} of its {fmt_ms(verdict.breakdown_ms['e2e'])} end to "
                            f"end is in none of these phases, more than its largest ({top}, "
                            f"{fmt_ms(known[top])}), so where its time went cannot be named. The observer timed "
                            f"that time but no phase of it: before the queue (rendering and tokenizing the "
                            f"prompt, a hand-over inside the engine) or after the last token (sending the answer).",
            {"known_ms": known, "unmeasured": [], "unreported": [], "unattributed_ms": other, "largest": top,
             "measures": None if facts.measures is None else sorted(facts.measures)},
        ))
        return
    bounds = unknown_bounds(known_parts(facts.request, facts.measures), e2e_of(facts.request))
    said = ", ".join(f"{name} {fmt_ms(value)}" for name, value in known.items()) or "none of its phases"
    could = sorted(name for name in bounds if bounds[name] is None
                   or not known or bounds[name] >= max(known.values())) or sorted(bounds)
    who = "; ".join(f"{name} is measured by {MEASURED_BY[name]}" for name in could)
    verdict.evidence.append(Evidence(
        "undecomposed", f"Known: {said}; {'; '.join(_why_unknown(unmeasured, unreported, bounds))}. "
                        f"Its largest part cannot be named: {' or '.join(could)} could be the largest"
                        + (f" (TTFT {fmt_ms(verdict.breakdown_ms['ttft'])})" if verdict.breakdown_ms["ttft"]
                           is not None else "") + f". {who[0].upper()}{who[1:]}.",
        {"known_ms": known, "unmeasured": unmeasured, "unreported": unreported,
         "measures": None if facts.measures is None else sorted(facts.measures),
         "at_most_ms": bounds, "could_be_largest": could, "measured_by": {name: MEASURED_BY[name] for name in could}},
    ))


def _count_of(value: int | None) -> str:
    return "an unknown number" if value is None else str(value)


def _uncached(row: dict) -> int:
    return max(0, (row.get("prompt_tokens") or 0) - (row.get("cached_tokens") or 0))


def exceeds(component: str, observed: Any, base: Any, scale: Any = 1) -> Any:
    """The abnormal test of one component: ``observed`` > factor x ``base`` + floor (THRESHOLDS), in
    the component's metric. Plain arithmetic, so that it holds for numbers (``_baseline``, one
    request) and for polars expressions (``analyzers.baseline``, a window of requests) alike."""
    factor, floor = THRESHOLDS[component]
    # The floor is in ms of the whole component, so per-token rates compare over this request's tokens.
    return observed * scale > factor * base * scale + floor


def _baseline(component: str, r: dict, history: list[dict]) -> dict[str, Any]:
    """Observed vs median of comparable recent requests, and the abnormal test."""
    factor, floor = THRESHOLDS[component]
    # Comparable: completed, not cold; a part a row does not carry is unknown, not 0, and left out.
    rows = [row for row in history if outcome_of(row) == COMPLETED and not (row.get("load_wait_ms") or 0)]
    if component == "prefill":
        uncached = max(1, _uncached(r))
        similar = [row for row in rows if row.get("prefill_ms") is not None
                   and uncached / 4 <= _uncached(row) <= uncached * 4 and _uncached(row) > 0]
        values = [row["prefill_ms"] / _uncached(row) for row in similar]
        observed, metric, unit = (r.get("prefill_ms") or 0.0) / uncached, "prefill_ms_per_uncached_token", "ms/token"
        scale = uncached
    elif component == "decode":
        values = [row["tpot_ms"] for row in rows if row.get("tpot_ms") is not None
                  and (row.get("completion_tokens") or 0) >= 2]
        observed, metric, unit, scale = r.get("tpot_ms") or 0.0, "tpot_ms", "ms", 1
    else:
        values = [row[f"{component}_ms"] for row in rows if row.get(f"{component}_ms") is not None]
        observed, metric, unit, scale = r.get(f"{component}_ms") or 0.0, f"{component}_ms", "ms", 1
    base = median(values)
    abnormal = None
    if len(values) >= MIN_SAMPLES and base is not None:
        abnormal = exceeds(component, observed, base, scale)
    return {"metric": metric, "unit": unit, "observed": round(observed, 4),
            "value": None if base is None else round(base, 4), "samples": len(values), "factor": factor,
            "floor_ms": floor, "abnormal": abnormal}


def _cold_start(verdict: SlowVerdict, facts: SlowFacts) -> None:
    waited = verdict.breakdown_ms["load_wait"]
    if not facts.load:
        verdict.evidence.append(Evidence("load", f"Waited {fmt_ms(waited)} for the model to load; the load "
                                                 "itself was not reported.", {"load_wait_ms": waited}))
        return
    load = facts.load[0]
    stages = [(row["stage"], (row["stage_end_ns"] - row["stage_start_ns"]) / 1e6)
              for row in facts.load if row["stage"]]
    total = (load["end_ns"] - load["start_ns"]) / 1e6
    verdict.evidence.append(Evidence(
        "load", f"Waited {fmt_ms(waited)} for model load {load['load_id']} "
                f"({'lazy, triggered by a request' if load['lazy'] else 'at start'}), "
                f"which took {fmt_ms(total)} in all.",
        {"load_id": load["load_id"], "lazy": load["lazy"], "load_ms": round(total, 3), "load_wait_ms": waited,
         "stages": [{"name": name, "ms": round(d, 3)} for name, d in stages]},
    ))
    if stages:
        name, duration = max(stages, key=lambda stage: stage[1])
        verdict.evidence.append(Evidence(
            "dominant_stage", f"The slowest stage was {name}: {fmt_ms(duration)} of {fmt_ms(total)}.",
            {"stage": name, "ms": round(duration, 3), "share": round(duration / total, 3) if total else None},
        ))


def _queueing(verdict: SlowVerdict, facts: SlowFacts) -> None:
    queue = _named(facts.phases, "llm.queue")
    waited = verdict.breakdown_ms["queue"]
    if queue:
        q = queue[0]
        t0, t1 = q["start_ns"], q["end_ns"]
        verdict.evidence.append(Evidence(
            "queue_depth", f"Arrived with {plural(q['queue_depth'], 'request')} waiting and "
                           f"{_count_of(q['queue_running'])} running"
                           + (f" (it admits {q['max_batch']} at once)" if q["max_batch"] is not None else "")
                           + f"; waited {fmt_ms(waited)}.",
            {"queue_depth": q["queue_depth"], "running": q["queue_running"], "max_batch": q["max_batch"],
             "queue_ms": waited},
        ))
    else:
        t0 = facts.request["start_ns"]
        t1 = t0 + int(waited * 1e6)
        verdict.evidence.append(Evidence(
            "queue_depth", f"Waited {fmt_ms(waited)} in the queue; this engine does not report the queue depth "
                           "at arrival.", {"queue_ms": waited}))
    blockers = []
    for row in facts.holders:
        held = min(row["end_ns"], t1) - max(row["admitted_ns"], t0)
        if held > 0:
            blockers.append((held, row))
    for held, row in sorted(blockers, key=lambda item: -item[0])[:5]:
        verdict.evidence.append(Evidence(
            "blocker", f"Request {row['request_id']} held a batch slot for {fmt_ms(held / 1e6)} of the wait "
                       f"(prompt {row['prompt_tokens']} tokens, output {row['completion_tokens']} tokens).",
            {"request_id": row["request_id"], "held_ms": ms(held), "prompt_tokens": row["prompt_tokens"],
             "completion_tokens": row["completion_tokens"], "admitted_ns": row["admitted_ns"], "end_ns": row["end_ns"]},
        ))


def _prefill(verdict: SlowVerdict, facts: SlowFacts) -> None:
    r, base = facts.request, verdict.baseline
    uncached, cached = _uncached(r), r.get("cached_tokens") or 0
    rate = uncached / (verdict.breakdown_ms["prefill"] / 1000) if verdict.breakdown_ms["prefill"] else None
    base_rate = 1000 / base["value"] if base.get("value") else None
    verdict.evidence.append(Evidence(
        "prefill_tokens", f"Computed {uncached} uncached prompt tokens; {cached} were reused from the cache.",
        {"uncached_tokens": uncached, "cached_tokens": cached, "prompt_tokens": r.get("prompt_tokens")},
    ))
    verdict.evidence.append(Evidence(
        "prefill_rate", f"Prefill ran at {rate:,.0f} tokens/s" + (f" against a baseline of {base_rate:,.0f} tokens/s "
                        f"over {base['samples']} comparable requests." if base_rate else "; no baseline yet.")
        if rate else "Prefill time was not reported.",
        {"tokens_per_s": round(rate, 1) if rate else None,
         "baseline_tokens_per_s": round(base_rate, 1) if base_rate else None},
    ))
    if facts.cache is not None:
        cache = facts.cache
        verdict.evidence.append(Evidence(
            "cache", f"Cache verdict: {cache.result}" + (f", cause {cache.cause}" if cache.cause else "") + ".",
            {"result": cache.result, "cause": cache.cause, "seen_tokens": cache.seen_tokens},
        ))


def _decode(verdict: SlowVerdict, facts: SlowFacts) -> None:
    r, base = facts.request, verdict.baseline
    tpot = verdict.breakdown_ms["tpot"]
    verdict.evidence.append(Evidence(
        "tpot", f"Time per output token {fmt_ms(tpot)}" + (f" against a baseline of {fmt_ms(base['value'])} over "
                f"{base['samples']} comparable requests." if base.get("value") else "; no baseline yet."),
        {"tpot_ms": tpot, "baseline_tpot_ms": base.get("value")},
    ))
    prompt, completion = r.get("prompt_tokens"), r.get("completion_tokens")
    if prompt is None or completion is None:  # unknown stays unknown: never "grew to 0 tokens"
        missing = " and ".join(name for name, value in (("prompt", prompt), ("output", completion)) if value is None)
        verdict.evidence.append(Evidence("context", f"Context size unknown: no {missing} token count was reported.",
                                         {"context_tokens": None}))
    else:
        verdict.evidence.append(Evidence("context", f"Context grew to {prompt + completion} tokens.",
                                         {"context_tokens": prompt + completion}))
    bandwidth = memory_bandwidth(r, tpot, facts.steps, facts.hardware) if facts.hardware else None
    if bandwidth is not None:
        verdict.evidence.append(bandwidth)
    if not facts.steps:
        return
    steps = facts.steps
    sizes = [row["decode_seqs"] for row in steps]
    verdict.evidence.append(Evidence(
        "batch", f"Decoded in {len(sizes)} engine steps with {sum(sizes) / len(sizes):.1f} sequences per step on "
                 f"average (max {max(sizes)}).",
        {"steps": len(sizes), "mean_batch": round(sum(sizes) / len(sizes), 2), "max_batch": max(sizes)},
    ))
    shared = [row for row in steps if row["prefill_tokens"] is not None and row["prefill_tokens"] > 0]
    if shared:
        others = sorted({rid for row in shared for rid in row["prefill_request_ids"] if rid != r["request_id"]})
        stalled_ms = sum(row["duration_ns"] or 0 for row in shared) / 1e6
        verdict.evidence.append(Evidence(
            "prefill_interference", f"{len(shared)} of its decode steps also computed prefill chunks of "
                                    f"{', '.join(others[:5]) or 'other requests'} "
                                    f"({fmt_ms(stalled_ms)} in those steps).",
            {"steps": len(shared), "step_ms": round(stalled_ms, 3), "prefill_request_ids": others,
             "prefill_tokens": sum(row["prefill_tokens"] for row in shared)},
        ))


def analyze_slowness(reader: TraceReader, request_id: str, slo: SloSpec | None = None) -> SlowVerdict:
    """Load and classify; with objectives, also say which of them the request missed."""
    facts = load_slow_facts(reader, request_id)
    verdict = classify_slowness(facts)
    verdict.slo_missed = missed_objectives(facts.request, slo)
    return verdict


def rank_split(instance_id: str, nodes: list[dict], phase: str) -> list[dict[str, Any]]:
    """Per rank of a distributed instance, the mean of the steps it timed while a request was in
    ``phase`` (its node_steps rows): the compute of its layers, its waits on the ring, the rest of
    the step and the whole step, in ms; [] for one process."""
    flag = "prefilling" if phase == "prefill" else "decoding"
    per_rank: dict[int, list[dict]] = {}
    for row in nodes:
        if row[flag] and row["duration_ns"]:
            per_rank.setdefault(c.node_rank(instance_id, row["instance_id"]), []).append(row)
    ranks = []
    for rank in sorted(per_rank):
        rows = per_rank[rank]
        mean = {key: sum(row[key] for row in rows) / len(rows) / 1e6 for key in ("compute_ns", "ring_wait_ns",
                                                                                "duration_ns")}
        # The CPU its process used in those waits, where it reported it: the ring's receive polls, so
        # a wait normally uses as much CPU as time, and the rest of it the rank spent off its CPU.
        cpu = [row for row in rows if row.get("ring_wait_cpu_ns") is not None]
        wait_cpu = sum(row["ring_wait_cpu_ns"] for row in cpu) / len(cpu) / 1e6 if cpu else None
        off = sum(max(row["ring_wait_ns"] - row["ring_wait_cpu_ns"], 0) for row in cpu) / len(cpu) / 1e6 if cpu \
            else None
        ranks.append({"rank": rank, "instance_id": rows[0]["instance_id"], "steps": len(rows),
                      "compute_ms": round(mean["compute_ns"], 3), "ring_wait_ms": round(mean["ring_wait_ns"], 3),
                      "step_ms": round(mean["duration_ns"], 3),
                      "rest_ms": round(max(mean["duration_ns"] - mean["compute_ns"] - mean["ring_wait_ns"], 0), 3),
                      "wait_share": round(mean["ring_wait_ns"] / mean["duration_ns"], 3),
                      "wait_cpu_ms": None if wait_cpu is None else round(wait_cpu, 3),
                      "off_cpu_ms": None if off is None else round(off, 3)})
    return ranks


#: A rank whose ring waits used at least this share of their time in CPU shows that the ring's
#: receive polls here (MLX's ring backend does); only then is a wait with less CPU read as time off
#: the CPU (a backend that blocks in its receive uses none while it waits, starved or not).
POLLING_SHARE = 0.8
#: A rank off its CPU for at least this share of its waits is starved (other work had its CPU); less
#: is the scheduling of a busy host, not named.
STARVED_SHARE = 0.25


def _starved(ranks: list[dict[str, Any]], link: float) -> tuple[dict[str, Any] | None, float]:
    """(the rank most off its CPU while it waited, the ms of the no-rank-computing time that was ranks
    starved rather than the ring): none where no rank's waits show that the receive polls, or no
    rank was off its CPU for STARVED_SHARE of its waits."""
    polling = any(r["wait_cpu_ms"] is not None and r["ring_wait_ms"] > 0
                  and r["wait_cpu_ms"] >= POLLING_SHARE * r["ring_wait_ms"] for r in ranks)
    off = [r for r in ranks if r["off_cpu_ms"] and r["off_cpu_ms"] >= STARVED_SHARE * r["ring_wait_ms"]]
    if not polling or not off:
        return None, 0.0
    return max(off, key=lambda r: r["off_cpu_ms"]), min(link, sum(r["off_cpu_ms"] for r in off))


def _cluster(verdict: SlowVerdict, facts: SlowFacts, phase: str) -> None:
    """A distributed instance: the phase's timed steps split, per rank, into the compute of its
    layers, its waits on the ring and the rest (embedding, head and sampling, which every rank
    computes alike); the slowest rank named against the fastest; and the ring itself: the part of a
    step in which no rank computed (transfers and latency: a step is the ranks' layers one after the
    other, the rest, and the ring)."""
    ranks = rank_split(verdict.instance_id, facts.nodes, phase)
    if len(ranks) < 2:
        return
    step = sum(r["step_ms"] for r in ranks) / len(ranks)
    rest = sum(r["rest_ms"] for r in ranks) / len(ranks)
    link = max(step - sum(r["compute_ms"] for r in ranks) - rest, 0.0)
    slow = max(ranks, key=lambda r: r["compute_ms"])
    fast = min(ranks, key=lambda r: r["compute_ms"])
    ratio = slow["compute_ms"] / fast["compute_ms"] if fast["compute_ms"] else None
    # No rank computing is the link, unless a rank was off its CPU then: starved, its own time lost.
    starved, lost = _starved(ranks, link)
    ring = link - lost
    worst = max(ranks, key=lambda r: r["compute_ms"] + (lost if starved is r else 0.0))
    cost = worst["compute_ms"] + (lost if starved is worst else 0.0)
    bottleneck = "ring" if ring > cost else f"rank {worst['rank']}"
    waits = ", ".join(f"{r['wait_share']:.0%} of rank {r['rank']}'s" for r in ranks)
    versus = (f"rank {slow['rank']} computes its layers {ratio:.1f}x as long as rank {fast['rank']} "
              if ratio is not None else f"rank {slow['rank']} computes its layers longest ")
    off = (f"; rank {starved['rank']} was off its CPU for {fmt_ms(starved['off_cpu_ms'])} of its "
           f"{fmt_ms(starved['ring_wait_ms'])} waits (starved by other work on its CPU: the ring's receive polls, "
           f"so a waiting rank uses as much CPU as time), {fmt_ms(lost)} of the {fmt_ms(link)} in which no rank "
           "computed" if starved is not None else "")
    verdict.evidence.append(Evidence("cluster", (
        f"{phase.capitalize()} on {len(ranks)} ranks ({plural(min(r['steps'] for r in ranks), 'timed step')}): "
        f"{versus}({fmt_ms(slow['compute_ms'])} vs {fmt_ms(fast['compute_ms'])} per step); waiting on the ring "
        f"took {waits} step time{off}; the ring itself (no rank computing{', not starved' if starved else ''}) "
        f"{fmt_ms(ring)} of each {fmt_ms(step)} step ({ring / step:.0%}). Bottleneck: {bottleneck}."), {
        "phase": phase, "ranks": ranks, "step_ms": round(step, 3), "ring_ms": round(ring, 3),
        "ring_share": round(ring / step, 3), "slowest_rank": slow["rank"],
        "starved_rank": starved["rank"] if starved else None, "starved_ms": round(lost, 3),
        "compute_ratio": round(ratio, 2) if ratio is not None else None, "bottleneck": bottleneck}))
