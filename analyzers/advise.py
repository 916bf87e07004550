"""Advice: over a window, the few changes that would matter most, ranked by the time they would save.

Every figure is computed from the store or from a replay of it, never from a constant; where a
change's effect cannot be computed the change says why (``why_not``). The unit every change is
ranked by is the waiting it would have saved the window's requests before their first token
(``saved_ms``: prefill recomputed, queue, load waits; and per hour of the window's span). The
definitions (docs/analyzers.md, "Advice"):

- **context**: the cache verdicts of the window's misses (the latest ``MAX_VERDICTS``) whose cause
  is ``prefix_change``, grouped by where the prompt first differed (role and index of the segment,
  or ``template``). A request's loss is what it would have reused had that segment stayed the same:
  its segments compared in order with the earlier request's, the first difference forgiven, up to
  the next one, in whole cache blocks, at most the prompt less one token, less what it reused. Its
  time is the loss at the instance's measured prefill rate (uncached tokens / prefill time).
- **routing**: with two instances or more, the window's traffic replayed (``whatif``) at each
  instance's own cache limits under each other routing policy against its recorded placement; the
  saving is the replay's TTFT saved by the policy less the recorded placement's. ``prefix`` is
  replayed with the block model (``whatif``'s rule), against the recorded placement in that model.
- **capacity**: per instance, its own requests replayed on its own cache at its declared limits
  scaled by ``CAPACITY_FACTORS`` and unlimited; the change is the smallest size that keeps
  ``KEEP_SHARE`` of what an unlimited cache would add; the capacity misses of the verdicts name the
  requests. Whether memory allows it: the extra KV bytes against the free memory each of its nodes reports.
- **concurrency**: per instance whose requests queued, a first-come-first-served model of its batch
  slots (``--max-batch`` from its heartbeats): each request arrives when its load wait ends and holds
  a slot as long as it did. The model is run at the current limit (its total wait is shown beside the
  measured one) and under each change: one more slot, twice the slots, a ``max_tokens`` cap at the
  95th percentile of the instance's answers (answers beyond it end early, at the request's own TPOT),
  and a second instance (arrivals to the one with fewer requests in it). Saving: the model's total
  wait now less under the change. A larger batch makes each decode step slower: under one more slot
  and twice the slots a request keeps its prefill and the rest of its hold, and its decode part
  (``decode_ms``) runs at the step time the instance's own decode steps give for the batch it then
  decodes in, against the one it measured (step_model.py: a fit of step time on batch size; past the
  largest batch measured it is extrapolated, and the change says so); an instance whose steps measured
  one batch size, or none, gets no saving for these, and the change says why.
- **cold_start**: the window's model loads; the requests that waited on each (load wait); a load
  that reloaded a model its process had loaded before (no process start between the two: an engine
  that unloads when idle) gets a keep-alive as long as the longest idle gap before such reloads,
  saving the waits on them; a process's first load, at start or on its first request, gets loading
  before taking traffic (a readiness check), saving the waits on it; restarts (the ``restart`` cache
  cause) the prefill they cost.
- **objectives**: with objectives (``--slo``), which is missed most, by which requests, and the
  slowness categories and cache causes of those requests, pointing at the kind above that addresses
  the most of them. It is not a change itself: no saving.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from tokentrace import contract as c
from tokentrace.analyzers.cache import CacheVerdict, analyze_cache
from tokentrace.analyzers.evidence import Evidence, fmt_bytes, fmt_ms, median, plural
from tokentrace.analyzers.outcome import COMPLETED
from tokentrace.analyzers.report import cause_candidates, declared_parts, routing_by_policy, with_categories
from tokentrace.analyzers.slo import SloSpec, judge
from tokentrace.analyzers.step_model import batched_waits, decode_batches, fit_steps
from tokentrace.analyzers.whatif import Capacity, Workload, own_model, recorded, replay
from tokentrace.analyzers.workload import load_workload, prefill_rates
from tokentrace.collector.stores.store import TraceReader
from tokentrace.threads import name_os_thread
from tokentrace.window import Slice

KINDS = ("context", "routing", "capacity", "concurrency", "cold_start", "objectives")
#: Cache verdicts computed over the window's misses (the latest first); figures that rest on them
#: say over how many of how many.
MAX_VERDICTS = 400
#: Savings are also given per hour only over a window with at least this much traffic: an hour's
#: figure extrapolated from seconds would be noise.
PER_HOUR_MIN_S = 300.0
#: Capacity sizes replayed, as multiples of an instance's own limits.
CAPACITY_FACTORS = (1.25, 1.5, 2, 3, 4, 8, 16)
#: The share of an unlimited cache's extra saving the recommended size keeps.
KEEP_SHARE = 0.9
#: A request counts as queued from this wait (the slowness verdict's abnormal floor for the queue).
QUEUED_MS = 25.0
#: Waits (the longest) whose blockers are looked for.
BLOCKER_WAITS = 50
#: The max_tokens cap tried: this percentile of the instance's answer lengths.
CAP_PERCENTILE = 0.95
#: What each routing policy is called in a change (the gateway's --route).
POLICY_CHANGES = {
    "session": "Route each session to the instance that served its previous turn (gateway --route session)",
    "prefix": "Route each request to the instance whose cache holds the longest part of its prompt "
              "(gateway --route prefix)",
    "least_loaded": "Route each request to the instance with the fewest requests in flight "
                    "(gateway --route least_loaded)",
    "round_robin": "Spread requests over the instances in turn (gateway --route round_robin)",
}


@dataclass
class Change:
    """One change and what it would have saved over the window."""

    change: str  #: what to change, one sentence
    saved_ms: float | None  #: waiting before the first token it would have saved; None: not computable
    requests: int  #: requests it would have changed
    prefill_tokens: int | None = None  #: prefill tokens it would have saved (cache changes)
    why_not: str | None = None  #: why ``saved_ms`` is None
    data: dict[str, Any] = field(default_factory=dict)  #: the figures behind it

    def as_dict(self, span_s: float | None) -> dict[str, Any]:
        tokens_per_hour = _per_hour(self.prefill_tokens, span_s)
        return {"change": self.change, "saved_ms": None if self.saved_ms is None else round(self.saved_ms, 3),
                "saved_ms_per_hour": _per_hour(self.saved_ms, span_s), "requests": self.requests,
                "prefill_tokens": self.prefill_tokens,
                "prefill_tokens_per_hour": None if tokens_per_hour is None else round(tokens_per_hour),
                "why_not": self.why_not, **self.data}


@dataclass
class Advice:
    """What one kind of lever found: the finding, its changes (best first), evidence and requests."""

    kind: str  #: one of KINDS
    finding: str  #: what the window shows, one sentence
    changes: list[Change] = field(default_factory=list)
    evidence: list[Evidence] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)  #: the requests it rests on
    requests: int = 0  #: how many requests it rests on
    instance_id: str | None = None  #: the instance it is about, when one

    def best(self) -> float | None:
        """The largest saving among its changes (None when none is computable)."""
        known = [c.saved_ms for c in self.changes if c.saved_ms is not None]
        return max(known) if known else None

    def as_dict(self, span_s: float | None) -> dict[str, Any]:
        best = self.best()
        return {"kind": self.kind, "finding": self.finding, "instance_id": self.instance_id,
                "saved_ms": None if best is None else round(best, 3),
                "saved_ms_per_hour": _per_hour(best, span_s),
                "changes": [c.as_dict(span_s) for c in self.changes],
                "evidence": [e.as_dict() for e in self.evidence],
                "request_ids": self.request_ids, "requests": self.requests}


def _per_hour(saved_ms: float | None, span_s: float | None) -> float | None:
    if saved_ms is None or not span_s or span_s < PER_HOUR_MIN_S:
        return None
    return round(saved_ms / span_s * 3600, 3)


def _ranked(changes: list[Change]) -> list[Change]:
    """Best first; changes that cannot be computed after those that can (stable otherwise)."""
    return sorted(changes, key=lambda c: (c.saved_ms is None, -(c.saved_ms or 0.0)))


# --- context -------------------------------------------------------------------------------------
def reusable_if_stable(ours: list[dict], theirs: list[dict], block: int, prompt: int) -> int:
    """Tokens this prompt would have reused from the earlier one had their first differing segment
    been the same: segments compared in order by role and content hash, the first difference
    forgiven, up to the next difference or the end of either; whole blocks, at most prompt - 1."""
    end, forgiven = 0, False
    for mine, other in zip(ours, theirs, strict=False):
        if (mine["role"], mine["hash"]) != (other["role"], other["hash"]):
            if forgiven:
                break
            forgiven = True
        end = mine["token_end"]
    return max(0, min(end // block * block, prompt - 1))


def _segments(reader: TraceReader, request: dict) -> list[dict]:
    return reader.rows("segments_of", request_id=request["request_id"], t0_ns=request["start_ns"] - 1_000_000_000,
                       t1_ns=request["end_ns"] + 1_000_000_000)


def _rate(rates: dict[str, float], instance: str | None) -> float | None:
    return rates.get(instance) if instance is not None else None


def _time_of(tokens: int, rate: float | None) -> float | None:
    return None if rate is None else tokens / rate * 1000


def context_advice(reader: TraceReader, verdicts: list[CacheVerdict], rows: dict[str, dict],
                   rates: dict[str, float], sample: str) -> Advice | None:
    """Prefix changes grouped by where prompts diverge (module docstring)."""
    groups: dict[tuple[str | None, int | None], list[dict]] = {}
    for verdict in verdicts:
        if verdict.cause != "prefix_change" or verdict.divergence is None:
            continue
        item = next((e.data for e in verdict.evidence if e.kind == "divergence"), None)
        earlier = reader.request(item["earlier_request_id"]) if item else None
        row = rows.get(verdict.request_id)
        lost = None  # the earlier request's rows are gone (another window, a damaged file): unpriced
        if earlier is not None and row is not None:
            would = reusable_if_stable(_segments(reader, row), _segments(reader, earlier), verdict.block_size,
                                       verdict.prompt_tokens or 0)
            lost = max(0, would - (verdict.cached_tokens or 0))
        key = (verdict.divergence.segment_role, verdict.divergence.segment_index)
        groups.setdefault(key, []).append({"request_id": verdict.request_id, "instance_id": verdict.instance_id,
                                           "lost": lost, "token": verdict.divergence.token_index,
                                           "snippet": item.get("snippet") if item else None,
                                           "earlier": item["earlier_request_id"] if item else None})
    if not groups:
        return None
    changes = []
    for (role, index), hits in groups.items():
        priced = [h for h in hits if h["lost"] is not None]
        tokens = sum(h["lost"] for h in priced)
        times = [_time_of(h["lost"], _rate(rates, h["instance_id"])) for h in priced]
        unknown = sum(t is None for t in times)
        where = _segment_name(role, index)
        token = median(h["token"] for h in hits)
        text = (f"Keep {where} the same from one request to the next: in {plural(len(hits), 'request')} the prompt "
                f"first differed there (around token {token:,.0f}) from an earlier prompt that was otherwise the "
                f"same there, and {tokens:,} prefill tokens after it were recomputed; move what changes (a date or "
                "time, a request id, a reordered tool list) after the shared part, or out of the prompt")
        snippet = next((h["snippet"] for h in hits if h["snippet"]), None)
        changes.append(Change(
            text, None if unknown else sum(times), len(hits), tokens,
            why_not=(f"{plural(unknown, 'request')} ran on an instance whose prefill rate is unknown (no prefill "
                     "time measured)") if unknown else None,
            data={"segment_role": role, "segment_index": index, "token_index_median": token,
                  "snippet": snippet, "request_ids": [h["request_id"] for h in hits],
                  "unpriced": len(hits) - len(priced)}))
    changes = _ranked(changes)
    everyone = [h for hits in groups.values() for h in hits]
    top = changes[0]
    advice = Advice("context", f"{plural(len(everyone), 'request')} of {sample} missed the cache because their "
                               "prompt changed where an earlier prompt was otherwise the same "
                               f"({_segment_name(top.data['segment_role'], top.data['segment_index'])} most).",
                    changes, request_ids=[h["request_id"] for h in everyone], requests=len(everyone))
    for hit in sorted((h for h in everyone if h["lost"] is not None), key=lambda h: -h["lost"])[:3]:
        advice.evidence.append(Evidence(
            "divergence", f"Request {hit['request_id']} recomputed {hit['lost']:,} tokens it shares with request "
                          f"{hit['earlier']}'s prompt: their prompts differ from token {hit['token']:,} on.",
            {"request_id": hit["request_id"], "earlier_request_id": hit["earlier"], "lost_tokens": hit["lost"],
             "token_index": hit["token"]}))
    return advice


def _segment_name(role: str | None, index: int | None) -> str:
    if role == "template":
        return "what lies between the messages (template markup, the tool list)"
    if role is None:
        return "the prompt's start"
    return f"the {role} message" + (" at the start of the prompt" if index == 0 else f" (segment {index})")


# --- routing -------------------------------------------------------------------------------------
def routing_advice(reader: TraceReader, workload: Workload, verdicts: list[CacheVerdict], since_ns: int | None,
                   until_ns: int | None, where: Slice) -> tuple[Advice | None, str | None]:
    """Each other policy replayed against the recorded placement (module docstring)."""
    n = len(workload.instances)
    if n < 2:
        return None, ("one instance served this window: routing has nothing to choose" if n == 1
                      else "no request of this window has a prompt fingerprint to replay")
    policies = routing_by_policy(reader, since_ns, until_ns, where)
    current = [row["policy"] for row in policies if row.get("policy")]
    own = Capacity(own=True)
    base = {"own": replay(workload, own, n, "recorded", model="own")}
    changes = []
    for route in ("session", "prefix", "least_loaded", "round_robin"):
        if route in current:
            continue
        model = "blocks" if route == "prefix" else "own"
        if model not in base:
            base[model] = replay(workload, own, n, "recorded", model=model)
        result = replay(workload, own, n, route, model=model)
        before = base[model]
        tokens = result["prefill_tokens_saved"] - before["prefill_tokens_saved"]
        saved = None if result["ttft_saved_ms"] is None or before["ttft_saved_ms"] is None \
            else result["ttft_saved_ms"] - before["ttft_saved_ms"]
        changes.append(Change(
            POLICY_CHANGES[route], saved, result["requests"], tokens,
            why_not=None if saved is not None else "an instance's prefill rate is unknown (no prefill time measured)",
            data={"route": route, "cache_model": model, "token_hit_ratio": result["token_hit_ratio"],
                  "token_hit_ratio_recorded_placement": before["token_hit_ratio"]}))
    moved = [v for v in verdicts if v.cause == "instance_change"]
    finding = (f"{plural(len(moved), 'request')} missed the cache because it went to another instance than the one "
               f"holding its prefix" + (f" (policy {', '.join(current)})" if current else "")
               + f"; the window's {plural(workload.requests and len(workload.requests), 'request')} replayed "
               f"over its {n} instances under each other policy.")
    advice = Advice("routing", finding, _ranked(changes), request_ids=[v.request_id for v in moved],
                    requests=len(moved))
    for verdict in moved[:3]:
        advice.evidence.append(Evidence(
            "instance_change", f"Request {verdict.request_id} ran on {verdict.instance_id}; its prefix was cached on "
                               f"{verdict.cached_on}.",
            {"request_id": verdict.request_id, "instance_id": verdict.instance_id, "cached_on": verdict.cached_on}))
    for row in policies:
        if row.get("avoidable_prefill_tokens"):
            advice.evidence.append(Evidence(
                "routing_regret", f"The gateway's {row['policy']} decisions left "
                                  f"{row['avoidable_prefill_tokens']:,} prefill tokens that another instance had "
                                  f"cached, in {plural(row.get('decisions_with_avoidable'), 'decision')}.",
                {"policy": row["policy"], "avoidable_prefill_tokens": row["avoidable_prefill_tokens"]}))
    return advice, None


# --- capacity ------------------------------------------------------------------------------------
def _own_limits(workload: Workload) -> tuple[int | None, int | None]:
    own = Capacity(own=True)
    return own.tokens_of(workload, 0), own.entries_of(workload, 0)


def capacity_advice(workload: Workload, verdicts: list[CacheVerdict], memory: dict[str, dict],
                    sample: str) -> list[Advice]:
    """Per instance, its own traffic replayed at larger caches (module docstring)."""
    out = []
    for name in workload.recorded_ids():
        mine = Workload([r for r in workload.requests if r.instance == name], workload.block_size, "store",
                        {name: workload.instances[name]}, workload.prefill_tokens_per_s, workload.kv_bytes_per_token)
        if not mine.requests:
            continue
        missed = [v for v in verdicts if v.cause == "capacity" and v.instance_id == name]
        tokens, entries = _own_limits(mine)
        model = own_model(mine, 0)
        if tokens is None and entries is None:
            if missed:
                out.append(Advice("capacity", f"{len(missed)} of {sample} were on {name} and found their "
                                              "prefix evicted.",
                                  [Change(f"Give {name}'s prompt cache more room", None, len(missed),
                                          why_not=f"{name} declares no cache limit (heartbeat), so no larger "
                                                  "size can be replayed")],
                                  request_ids=[v.request_id for v in missed], requests=len(missed), instance_id=name))
            continue
        base = replay(mine, Capacity(own=True), 1, "recorded", model="own")
        unlimited = replay(mine, Capacity(), 1, "recorded", model=model)
        gain = unlimited["prefill_tokens_saved"] - base["prefill_tokens_saved"]
        if gain <= 0:
            continue
        curve, chosen = [], None
        for factor in CAPACITY_FACTORS:
            for size in _sizes(tokens, entries, factor):
                result = replay(mine, size, 1, "recorded", model=model)
                point = {"factor": factor, "capacity_tokens": size.tokens, "capacity_entries": size.entries,
                         "prefill_tokens_saved": result["prefill_tokens_saved"],
                         "ttft_saved_ms": result["ttft_saved_ms"], "token_hit_ratio": result["token_hit_ratio"]}
                curve.append(point)
                if chosen is None and point["prefill_tokens_saved"] - base["prefill_tokens_saved"] >= KEEP_SHARE * gain:
                    chosen = point
        point = chosen or {"factor": None, "capacity_tokens": None, "capacity_entries": None,
                           "prefill_tokens_saved": unlimited["prefill_tokens_saved"],
                           "ttft_saved_ms": unlimited["ttft_saved_ms"], "token_hit_ratio": unlimited["token_hit_ratio"]}
        saved = None if point["ttft_saved_ms"] is None or base["ttft_saved_ms"] is None \
            else point["ttft_saved_ms"] - base["ttft_saved_ms"]
        kv = workload.instances[name].kv_bytes_per_token
        size_text = _size_text(point, tokens, entries, kv)
        extra_tokens = None if point["capacity_tokens"] is None or tokens is None \
            else point["capacity_tokens"] - tokens
        extra = None if kv is None or extra_tokens is None else extra_tokens * kv
        room = _room(name, extra_tokens, kv, memory)
        change = Change(
            f"Give {name}'s prompt cache {size_text}: the replay of its own requests keeps "
            f"{KEEP_SHARE:.0%} or more of what an unlimited cache would add", saved,
            len(mine.requests), point["prefill_tokens_saved"] - base["prefill_tokens_saved"],
            why_not=None if saved is not None else f"{name}'s prefill rate is unknown (no prefill time measured)",
            data={"capacity_tokens": point["capacity_tokens"], "capacity_entries": point["capacity_entries"],
                  "factor": point["factor"], "extra_kv_bytes": extra, **room, "curve": curve,
                  "own": {"capacity_tokens": tokens, "capacity_entries": entries, "cache_model": model,
                          "token_hit_ratio": base["token_hit_ratio"],
                          "prefill_tokens_saved": base["prefill_tokens_saved"]}})
        achieved = (recorded(mine) or {}).get("token_hit_ratio")
        advice = Advice("capacity", f"{len(missed)} of {sample} were on {name} and found their prefix "
                                    f"evicted; at its own limits its traffic replays to a token hit ratio of "
                                    f"{_pct(base['token_hit_ratio'])} (the engine achieved {_pct(achieved)}), "
                                    f"unlimited to {_pct(unlimited['token_hit_ratio'])}.",
                        [change], request_ids=[v.request_id for v in missed], requests=len(missed), instance_id=name)
        for verdict in missed[:3]:
            evicted = f"by request {verdict.evicted_by}'s insert" if verdict.evicted_by else "before its lookup"
            advice.evidence.append(Evidence(
                "capacity_miss", f"Request {verdict.request_id} found its {verdict.seen_tokens or 0:,}-token prefix "
                                 f"evicted {evicted}.",
                {"request_id": verdict.request_id, "evicted_by": verdict.evicted_by}))
        advice.evidence.append(Evidence("memory", room["memory"], {"extra_kv_bytes": extra, **{
            key: room[key] for key in ("memory_bytes", "memory_free_bytes", "fits", "nodes")}}))
        out.append(advice)
    return out


def _sizes(tokens: int | None, entries: int | None, factor: float) -> list[Capacity]:
    """The sizes tried at ``factor``: each declared limit raised alone (the other kept), then both."""
    more_tokens = None if tokens is None else int(tokens * factor)
    more_entries = None if entries is None else max(entries + 1, int(entries * factor))
    sizes = []
    if tokens is not None:
        sizes.append(Capacity(tokens=more_tokens, entries=entries))
    if entries is not None:
        sizes.append(Capacity(tokens=tokens, entries=more_entries))
    if tokens is not None and entries is not None:
        sizes.append(Capacity(tokens=more_tokens, entries=more_entries))
    return sizes


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _size_text(point: dict, tokens: int | None, entries: int | None, kv: int | None) -> str:
    if point["factor"] is None:
        return "room for all its traffic (no size up to 16x its own keeps it)"
    parts = []
    if point["capacity_tokens"] is not None and point["capacity_tokens"] != tokens:
        size = f"{point['capacity_tokens']:,} tokens"
        if kv:
            size += f" ({fmt_bytes(point['capacity_tokens'] * kv)} of KV)"
        parts.append(size + f" instead of {tokens:,}")
    if point["capacity_entries"] is not None and point["capacity_entries"] != entries:
        parts.append(f"{point['capacity_entries']:,} entries instead of {entries:,}")
    return " and ".join(parts)


def _room(name: str, extra_tokens: int | None, kv: int | None, beats: dict[str, dict]) -> dict[str, Any]:
    """Whether the memory an instance reports free holds a larger cache: ``extra_tokens`` more tokens
    of KV on each of its nodes (one process: itself; a distributed instance, ``<name>/rank<r>``: each
    rank its own share, at its latest heartbeat). ``fits``: True, False, or None where a node reports
    no free memory (or no KV bytes per token); the text says which."""
    beat = beats.get(name, {})
    held, free = beat.get("memory_bytes"), beat.get("memory_free_bytes")
    out: dict[str, Any] = {"memory_bytes": held, "memory_free_bytes": free, "fits": None, "nodes": None}
    if extra_tokens is None or not kv:
        out["memory"] = f"How many bytes this takes is unknown: {name} reports no KV bytes per token."
        return out
    ranks = {0: beat, **{c.node_rank(name, other): b for other, b in beats.items() if other.startswith(name + "/rank")}}
    nodes = [{"rank": rank, "kv_bytes_per_token": b.get("kv_bytes_per_token"),
              "extra_kv_bytes": extra_tokens * b["kv_bytes_per_token"] if b.get("kv_bytes_per_token") else None,
              "memory_free_bytes": b.get("memory_free_bytes")} for rank, b in sorted(ranks.items())]
    for node in nodes:
        node["fits"] = None if node["extra_kv_bytes"] is None or node["memory_free_bytes"] is None \
            else node["extra_kv_bytes"] <= node["memory_free_bytes"]
    known = [n["fits"] for n in nodes]
    out["fits"] = False if False in known else (None if None in known else True)
    if len(nodes) > 1:
        out["nodes"] = nodes
    extra = extra_tokens * kv
    held_text = f"it holds {fmt_bytes(held)} now" if held else "it reports no memory figure"
    if len(nodes) > 1:
        short = [n for n in nodes if n["fits"] is False]
        unknown = [n for n in nodes if n["fits"] is None]
        where = "; ".join(f"rank {n['rank']} {fmt_bytes(n['extra_kv_bytes'])} of its "
                          f"{fmt_bytes(n['memory_free_bytes'])} free" for n in nodes if n["fits"] is not None)
        verdict = (f"it does not fit on rank {short[0]['rank']}" if short else
                   f"whether it fits is unknown: rank {unknown[0]['rank']} reports no free memory" if unknown
                   else "it fits on every node")
        out["memory"] = (f"This takes {extra_tokens:,} more tokens of KV on each of {name}'s {len(nodes)} nodes "
                         f"({where}): {verdict}.")
    elif free is None:
        out["memory"] = (f"This takes {fmt_bytes(extra)} more KV memory on {name}; {held_text}, and it reports no "
                         "free memory, so whether it fits is for the operator to check.")
    else:
        out["memory"] = (f"This takes {fmt_bytes(extra)} more KV memory on {name}; {held_text} and reports "
                         f"{fmt_bytes(free)} free: " + ("it fits." if out["fits"] else
                                                        f"it does not fit ({fmt_bytes(extra - free)} short)."))
    return out


# --- concurrency ---------------------------------------------------------------------------------
def fifo_waits(arrivals: list[float], holds: list[float], slots: int, instances: int = 1) -> list[float]:
    """Waits (ms) of requests arriving at ``arrivals`` (ms, ascending) that each hold a slot for
    ``holds`` ms, first come first served over ``slots`` slots per instance; with several instances
    each arrival goes to the one with the fewest requests in it (ties: the lowest index)."""
    free = [[0.0] * slots for _ in range(instances)]  # per instance: when each slot is next free (heaps)
    ends: list[list[float]] = [[] for _ in range(instances)]  # per instance: when its requests leave (heaps)
    waits = []
    for arrival, hold in zip(arrivals, holds, strict=True):
        for heap in ends:
            while heap and heap[0] <= arrival:
                heapq.heappop(heap)
        k = min(range(instances), key=lambda i: (len(ends[i]), i))
        start = max(arrival, heapq.heappop(free[k]))
        heapq.heappush(free[k], start + hold)
        heapq.heappush(ends[k], start + hold)
        waits.append(start - arrival)
    return waits


def concurrency_advice(frame: pl.DataFrame, max_batch: dict[str, int | None], reader: TraceReader) -> list[Advice]:
    """Per instance whose requests queued: the slot model under each change (module docstring); its
    engine steps (``reader``) price a larger batch's slower steps."""
    out = []
    done = frame.filter((pl.col("outcome") == COMPLETED) & pl.col("instance_id").is_not_null())
    for (name,), rows in done.group_by(["instance_id"], maintain_order=True):
        queued = rows.filter(pl.col("queue_ms").fill_null(0) >= QUEUED_MS)
        if queued.is_empty():
            continue
        rows = rows.filter(pl.col("queue_ms").is_not_null()).sort("start_ns")
        slots = max_batch.get(name)
        recorded = float(rows["queue_ms"].sum())
        finding = (f"{plural(queued.height, 'request')} on {name} waited {QUEUED_MS:.0f} ms or more for a batch "
                   f"slot, {fmt_ms(recorded)} in all.")
        advice = Advice("concurrency", finding, request_ids=queued.sort("queue_ms", descending=True)["request_id"]
                        .to_list(), requests=queued.height, instance_id=name)
        advice.evidence += _blockers(rows, queued)
        if not slots:
            advice.changes.append(Change(f"Let {name} run more requests at once", None, queued.height,
                                         why_not=f"{name} reports no batch limit (heartbeat max_batch)"))
            out.append(advice)
            continue
        t0 = rows["start_ns"].min()
        load = rows["load_wait_ms"].fill_null(0.0)
        arrivals = ((rows["start_ns"] - t0) / 1e6 + load).to_list()
        holds = ((rows["end_ns"] - rows["start_ns"]) / 1e6 - load - rows["queue_ms"]).clip(0.0).to_list()
        now = sum(fifo_waits(arrivals, holds, slots))
        advice.evidence.append(Evidence(
            "queue_model", f"At its limit of {plural(slots, 'request')} at once the slot model gives "
                           f"{fmt_ms(now)} of waiting in all; {fmt_ms(recorded)} was measured.",
            {"batch_limit": slots, "model_wait_ms": round(now, 3), "measured_wait_ms": round(recorded, 3)}))
        tried = []
        larger = _larger_batches(reader, name, rows, arrivals, holds, slots)
        for text, waits, data in larger:
            if waits is None:
                advice.changes.append(Change(text, None, queued.height, why_not=data.pop("why_not"), data=data))
            else:
                tried.append((text, waits, data))
        completion = rows["completion_tokens"].fill_null(0)
        cap = int(completion.quantile(CAP_PERCENTILE, "nearest") or 0)
        over = (completion - cap).clip(0)
        if cap > 0 and int((over > 0).sum()):
            capped = (pl.Series(holds) - (over * rows["tpot_ms"].fill_null(0.0))).clip(0.0).to_list()
            cut = int((over > 0).sum())
            tried.append((f"Cap answers on {name} at max_tokens {cap} (the {CAP_PERCENTILE:.0%} percentile of its "
                          f"answers; {plural(cut, 'answer')} of the window would have ended early)",
                          fifo_waits(arrivals, capped, slots), {"max_tokens": cap, "answers_cut": cut}))
        tried.append((f"Add a second instance beside {name}, each request sent to the one with fewer requests in it",
                      fifo_waits(arrivals, holds, slots, 2), {"instances": 2}))
        base = fifo_waits(arrivals, holds, slots)
        for text, waits, data in tried:
            helped = sum(1 for a, b in zip(base, waits, strict=True) if b < a - 1e-6)
            advice.changes.append(Change(text, now - sum(waits), helped,
                                         data={**data, "model_wait_ms": round(sum(waits), 3)}))
        advice.changes = _ranked(advice.changes)
        out.append(advice)
    return out


def _larger_batches(reader: TraceReader, name: str, rows: pl.DataFrame, arrivals: list[float], holds: list[float],
                    slots: int) -> list[tuple[str, list[float] | None, dict[str, Any]]]:
    """One more slot and twice the slots: (text, the model's waits or None, figures) each. A request's
    prefill and the rest of its hold are kept; its decode part (``decode_ms``) runs at the step time the
    instance's own decode steps give for the batch the model runs then (step_model.py); without a
    model (no steps, one batch size measured) the figures say why not."""
    steps = reader.bulk("steps_in", since_ns=int(rows["start_ns"].min()), until_ns=int(rows["end_ns"].max()) + 1,
                        instance_id=name)
    model, why = fit_steps(steps)
    if model is not None:
        per_request, overall = decode_batches(steps)
        decode = [min(h, d) for h, d in zip(holds, rows["decode_ms"].fill_null(0.0).to_list(), strict=True)]
        fixed = [h - d for h, d in zip(holds, decode, strict=True)]
        measured = [model.ms(per_request.get(rid, overall)) for rid in rows["request_id"].to_list()]
    out = []
    for limit in sorted({slots + 1, slots * 2}):
        text = f"Raise {name}'s batch limit from {slots} to {limit} (--max-batch {limit}) if its memory holds the " \
               "extra sequences"
        if model is None:
            out.append((text, None, {"batch_limit": limit, "step_model": None,
                                     "why_not": f"how much slower a step of up to {limit} sequences runs on {name} is "
                                                f"unknown: {why}"}))
            continue
        fit = model.as_dict(limit)
        sizes = ", ".join(f"{plural(s, 'step')} at {n}" for n, s, _ in model.sizes)
        text += (f"; a decode step of {limit} sequences then takes {fmt_ms(fit['step_ms_at'])} by a fit on its "
                 f"{plural(fit['steps'], 'decode step')} ({sizes})"
                 + (f", extrapolated beyond the {model.largest()} it measured" if fit["extrapolated"] else ""))
        out.append((text, batched_waits(arrivals, fixed, decode, measured, limit, model.ms),
                    {"batch_limit": limit, "step_model": fit}))
    return out


def _blockers(rows: pl.DataFrame, queued: pl.DataFrame) -> list[Evidence]:
    """The requests that held slots longest while others waited: their slot time overlapping the
    waits of the ``BLOCKER_WAITS`` longest waits."""
    load = pl.col("load_wait_ms").fill_null(0.0)
    held = rows.with_columns((pl.col("start_ns") + ((load + pl.col("queue_ms")) * 1e6).cast(pl.Int64))
                             .alias("admitted_ns"))
    waits = queued.top_k(BLOCKER_WAITS, by="queue_ms").with_columns(
        (pl.col("start_ns") + (load * 1e6).cast(pl.Int64)).alias("w0"),
        (pl.col("start_ns") + ((load + pl.col("queue_ms")) * 1e6).cast(pl.Int64)).alias("w1"))
    totals: Counter[str] = Counter()
    for w in waits.iter_rows(named=True):
        overlap = (pl.min_horizontal(pl.col("end_ns"), pl.lit(w["w1"]))
                   - pl.max_horizontal(pl.col("admitted_ns"), pl.lit(w["w0"])))
        hit = held.filter(pl.col("request_id") != w["request_id"]).select("request_id", overlap.alias("ns")) \
            .filter(pl.col("ns") > 0)
        totals.update(dict(hit.iter_rows()))
    info = {row["request_id"]: row for row in held.filter(pl.col("request_id").is_in(list(totals)))
            .iter_rows(named=True)}
    out = []
    for rid, ns in totals.most_common(3):
        row = info[rid]
        out.append(Evidence(
            "blocker", f"Request {rid} held a slot for {fmt_ms(ns / 1e6)} of others' waits (prompt "
                       f"{row['prompt_tokens'] or 0:,} tokens, answer {row['completion_tokens'] or 0:,} tokens).",
            {"request_id": rid, "held_ms": round(ns / 1e6, 3), "completion_tokens": row["completion_tokens"]}))
    return out


# --- cold starts and restarts --------------------------------------------------------------------
def _process_starts(reader: TraceReader) -> dict[str, list[int]]:
    """instance -> the times its engine processes started (``instance.started``), ascending."""
    starts: dict[str, list[int]] = {}
    for row in reader.frame("lifecycle").filter(pl.col("event") == c.EVENT_STARTED).iter_rows(named=True):
        starts.setdefault(row["instance_id"], []).append(row["t_ns"])
    return {name: sorted(times) for name, times in starts.items()}


def _reload(load: dict, previous: dict | None, starts: list[int]) -> bool:
    """Whether a load reloaded a model its process had already loaded (an engine that unloads when
    idle): an earlier load of the instance, and no process start between the two."""
    return previous is not None and not any(previous["start_ns"] < t <= load["start_ns"] for t in starts)


def cold_start_advice(reader: TraceReader, frame: pl.DataFrame, verdicts: list[CacheVerdict],
                      rates: dict[str, float], since_ns: int | None, until_ns: int | None,
                      where: Slice) -> list[Advice]:
    """Loads, the waits on them, keep-alive and readiness, restarts (module docstring)."""
    stages = reader.frame("loads_in", since_ns=since_ns, until_ns=until_ns)
    if where.instance_id is not None:
        stages = stages.filter(pl.col("instance_id") == where.instance_id)
    instances = set(frame["instance_id"].drop_nulls().to_list())
    process_starts = _process_starts(reader)
    out = []
    loads: dict[tuple[str, str], dict] = {}
    for row in stages.iter_rows(named=True):
        if row["instance_id"] not in instances:
            continue
        load = loads.setdefault((row["instance_id"], row["load_id"]), {**row, "stages": []})
        if row["stage"]:
            load["stages"].append((row["stage"], (row["stage_end_ns"] - row["stage_start_ns"]) / 1e6))
    waited = frame.filter(pl.col("load_wait_ms").fill_null(0) > 0)
    for name in sorted(instances):
        mine = sorted((v for (i, _), v in loads.items() if i == name), key=lambda v: v["start_ns"])
        waits = waited.filter(pl.col("instance_id") == name)
        restarts = [v for v in verdicts if v.cause == "restart" and v.instance_id == name]
        if not mine and waits.is_empty() and not restarts:
            continue
        starts = [t for t in process_starts.get(name, []) if since_ns is None or t >= since_ns]
        served = frame.filter(pl.col("instance_id") == name).sort("end_ns")
        per_load: dict[str, list[dict]] = {}
        for row in waits.iter_rows(named=True):
            # the load that ended first at or after the request arrived
            load = next((v for v in mine if v["end_ns"] >= row["start_ns"]), None)
            per_load.setdefault(load["load_id"] if load else "", []).append(row)
        reloads = [v for k, v in enumerate(mine) if v["lazy"] and _reload(v, mine[k - 1] if k else None,
                                                                           process_starts.get(name, []))]
        first = [v for v in mine if v not in reloads]
        durations = [(v["end_ns"] - v["start_ns"]) / 1e6 for v in mine]
        slowest_stage = Counter(max(v["stages"], key=lambda s: s[1])[0] for v in mine if v["stages"])
        stage_text = (f"; the slowest stage was {slowest_stage.most_common(1)[0][0]} in "
                      f"{plural(slowest_stage.most_common(1)[0][1], 'load')}") if slowest_stage else ""
        finding = (f"{name} loaded its model {plural(len(mine), 'time')} in the window "
                   f"({len(reloads)} reloaded after it had unloaded, {len(first)} a process's first; median "
                   f"{fmt_ms(median(durations))}{stage_text}); {plural(len(starts), 'process start')}; "
                   f"{plural(waits.height, 'request')} waited on a load"
                   + (f", and {plural(len(restarts), 'request')} found the cache emptied by a restart" if restarts
                      else "") + ".")
        advice = Advice("cold_start", finding, request_ids=waits["request_id"].to_list()
                        + [v.request_id for v in restarts], requests=waits.height + len(restarts), instance_id=name)
        for v in mine[:3]:
            how = "reloaded after unloading" if v in reloads else "triggered by a request" if v["lazy"] else "at start"
            advice.evidence.append(Evidence(
                "load", f"Load {v['load_id']} ({how}) took {fmt_ms((v['end_ns'] - v['start_ns']) / 1e6)}"
                        + (f"; {plural(len(per_load.get(v['load_id'], [])), 'request')} waited on it." if
                           per_load.get(v["load_id"]) else "."),
                {"load_id": v["load_id"], "lazy": v["lazy"], "reload": v in reloads,
                 "load_ms": round((v["end_ns"] - v["start_ns"]) / 1e6, 3),
                 "stages": [{"name": s, "ms": round(d, 3)} for s, d in v["stages"]]}))
        reload_rows = [row for v in reloads for row in per_load.get(v["load_id"], [])]
        if reload_rows:
            gaps = []
            for v in reloads:
                before = served.filter(pl.col("end_ns") <= v["start_ns"])
                gaps.append(None if before.is_empty() else (v["start_ns"] - before["end_ns"].max()) / 1e6)
            known = [g for g in gaps if g is not None]
            keep = max(known) if known else None
            text = (f"Keep {name}'s model loaded for at least {fmt_ms(keep)} after its last request (keep-alive): "
                    f"the idle gaps before its {plural(len(reloads), 'reload')} were at most that"
                    if keep is not None else f"Keep {name}'s model loaded between requests (keep-alive)")
            advice.changes.append(Change(text, sum(r["load_wait_ms"] for r in reload_rows), len(reload_rows),
                                         data={"keep_alive_ms": None if keep is None else round(keep, 3),
                                               "loads": len(reloads)}))
        first_rows = [row for v in first for row in per_load.get(v["load_id"], [])] + per_load.get("", [])
        if first_rows:
            lazy = any(v["lazy"] for v in first)
            advice.changes.append(Change(
                f"Load {name}'s model before it takes traffic"
                + (" (at start, not on its first request)" if lazy else "")
                + ", and send it no request until it is ready (a readiness check)",
                sum(r["load_wait_ms"] for r in first_rows), len(first_rows), data={"loads": len(first)}))
        if restarts:
            tokens = sum(max(0, (v.seen_tokens or 0) - (v.cached_tokens or 0)) // v.block_size * v.block_size
                         for v in restarts)
            rate = _rate(rates, name)
            advice.changes.append(Change(
                f"Avoid restarting {name} ({plural(len(starts), 'process start')} in the window): "
                f"{plural(len(restarts), 'request')} recomputed prefixes its cache held before a restart",
                _time_of(tokens, rate), len(restarts), tokens,
                why_not=None if rate else f"{name}'s prefill rate is unknown (no prefill time measured)",
                data={"process_starts": len(starts)}))
        if not advice.changes:
            continue
        advice.changes = _ranked(advice.changes)
        out.append(advice)
    return out


# --- objectives ----------------------------------------------------------------------------------
#: The kind of lever that addresses each slowness category and cache cause.
LEVER = {"queueing": "concurrency", "cold_start": "cold_start", "prefix_change": "context",
         "instance_change": "routing", "capacity": "capacity", "restart": "cold_start"}


def objectives_advice(frame: pl.DataFrame, spec: SloSpec | None, verdicts: list[CacheVerdict]) -> Advice | None:
    """The objective missed most, by which requests, for which causes (module docstring)."""
    if spec is None or frame.is_empty():
        return None
    judged = judge(frame, spec)
    counts = {name: int((~judged[f"slo_{name}"].drop_nulls()).sum()) for name in spec.names()}
    name, missed = max(counts.items(), key=lambda item: item[1])
    if not missed:
        return None
    rows = judged.filter(judged[f"slo_{name}"].not_().fill_null(False))
    categories = Counter(c for c in rows["category"].to_list() if c)
    causes = Counter(v.cause for v in verdicts if v.request_id in set(rows["request_id"].to_list()) and v.cause)
    levers = Counter()
    for label, count in [*categories.items(), *causes.items()]:
        if label in LEVER:
            levers[LEVER[label]] += count
    top = ", ".join(f"{label} {count}" for label, count in categories.most_common(3))
    cause_text = ", ".join(f"{label} {count}" for label, count in causes.most_common(3))
    per = ", ".join(f"{n} {c}" for n, c in counts.items())
    finding = (f"The {name} objective was missed by {plural(missed, 'request')} of {judged.height} "
               f"({per} missed per objective); slowest part: {top or 'n/a'}"
               + (f"; cache causes: {cause_text}" if cause_text else "") + ".")
    lever = levers.most_common(1)[0][0] if levers else None
    change = Change(
        f"Address the {lever} advice first: it covers most of the requests that missed {name}" if lever else
        f"The requests that missed {name} have no common cause a change above addresses", None, missed,
        why_not="an objective is met through the changes of the other kinds; this names which of them its misses need",
        data={"objective": name, "missed": counts, "categories": dict(categories), "causes": dict(causes),
              "lever": lever})
    return Advice("objectives", finding, [change], request_ids=rows["request_id"].to_list(), requests=missed)


# --- the whole ----------------------------------------------------------------------------------
def advise(reader: TraceReader, since_ns: int | None, until_ns: int | None = None, where: Slice | None = None,
           slo: SloSpec | None = None, max_verdicts: int = MAX_VERDICTS, limit: int = 1_000_000,
           verdict_of: Callable[[TraceReader, str], CacheVerdict] = analyze_cache) -> dict[str, Any]:
    """The advice over requests that started in [since, until) of the slice ``where`` (JSON-ready);
    ``verdict_of`` computes (or remembers: the live pages) a request's cache verdict."""
    where = where or Slice()
    frame = with_categories(reader.bulk("requests_report", since_ns=since_ns, until_ns=until_ns, limit=limit,
                                        **where.params()), declared_parts(reader))
    result: dict[str, Any] = {"window": {"since_ns": since_ns, "until_ns": until_ns}, "slice": where.params(),
                              "requests": frame.height, "span_s": None, "verdicts": 0, "misses": 0,
                              "advice": [], "nothing": {}}
    if frame.is_empty():
        result["nothing"] = {kind: "no request in this window" for kind in KINDS}
        return result
    span_s = max(1e-9, (frame["end_ns"].max() - frame["start_ns"].min()) / 1e9)
    completed = frame.filter(pl.col("outcome") == COMPLETED)
    rates = prefill_rates(completed)
    candidates = cause_candidates(frame, max(0, max_verdicts))
    misses = cause_candidates(frame, frame.height).height
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokentrace-advise", initializer=name_os_thread) as pool:
        verdicts = list(pool.map(lambda rid: verdict_of(reader, rid), candidates["request_id"].to_list()))
    sample = (f"the {plural(len(verdicts), 'miss', 'misses')} explained" if len(verdicts) == misses
              else f"the latest {len(verdicts)} of {misses} misses explained")
    rows = {row["request_id"]: row for row in candidates.iter_rows(named=True)}
    beats = {row["instance_id"]: row for row in reader.frame("latest_heartbeats").iter_rows(named=True)}
    workload = load_workload(reader, since_ns, until_ns, where=where)
    found: list[Advice] = []
    nothing: dict[str, str] = {}
    context = context_advice(reader, verdicts, rows, rates, sample)
    if context is None:
        nothing["context"] = f"no prefix change among {sample}"
    else:
        found.append(context)
    routing, why = routing_advice(reader, workload, verdicts, since_ns, until_ns, where)
    if routing is None:
        nothing["routing"] = why
    else:
        found.append(routing)
    capacity = capacity_advice(workload, verdicts, beats, sample)
    found += capacity
    if not capacity:
        nothing["capacity"] = "no instance's traffic would reuse more with a larger cache (replayed)"
    concurrency = concurrency_advice(frame, {k: v.get("max_batch") for k, v in beats.items()}, reader)
    found += concurrency
    if not concurrency:
        nothing["concurrency"] = f"no request waited {QUEUED_MS:.0f} ms or more for a batch slot"
    cold = cold_start_advice(reader, frame, verdicts, rates, since_ns, until_ns, where)
    found += cold
    if not cold:
        nothing["cold_start"] = "no request waited on a model load, and no cache was emptied by a restart"
    objectives = objectives_advice(frame, slo, verdicts)
    if objectives is None:
        nothing["objectives"] = "no objectives set (--slo)" if slo is None else "every objective was met"
    found.sort(key=lambda a: (a.best() is None, -(a.best() or 0.0)))
    if objectives is not None:
        found.append(objectives)
    result.update(span_s=round(span_s, 3), verdicts=len(verdicts), misses=misses,
                  advice=[a.as_dict(span_s) for a in found], nothing=nothing, sample=sample)
    return result
