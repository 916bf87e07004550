"""Session verdict: an agent's or a chat's turns, the gaps between them, and whether the prefix cache
survived each gap.

Definitions (the contract; docs/analyzers.md):
- ``turns``: the session's requests (same session id), oldest first, at most ``MAX_TURNS``; each with
  its TTFT, prompt and cached tokens, both verdicts (slowness category, cache result and cause) and
  ``gap_ms``: its start minus the previous turn's end (the tool or user time; None for the first).
- ``survived`` for a turn after the first: False when its cache cause says the cache lost what the
  previous turns left — ``capacity`` (evicted: ``taken_by`` names the eviction and the insert that
  pushed it out), ``restart`` (the instance restarted or reloaded) or ``instance_change`` (the turn
  moved: ``taken_by`` names the instance that holds it); None when the cause is ``unknown``; True
  otherwise (a hit, or a miss the cache is not to blame for: the prompt changed or is new).
- ``cold_turns``: the turns with ``survived`` False.
- ``instances``: per instance that served the session, over every session's follow-up turns on it
  in [first turn - ``THRESHOLD_LOOKBACK_NS``, last turn's end] whose previous turn ran on the same
  instance: a follow-up is *warm* when its cached tokens reach the previous turn's prompt (whole
  blocks, less one); one that did not is *cold* only when its cache verdict says the cache lost it
  with time (``TIMED``: evicted, or the instance restarted), *changed* when the verdict blames the
  prompt (changed, new, too short: the gap had nothing to do with it), and *unknown* when nothing
  says (cached tokens not measured, cause unknown, or past ``MAX_COLD_VERDICTS`` verdicts).
  ``cold_after_ms`` is the shortest gap g such that every warm or cold follow-up with a gap of g or
  more came back cold (None when the longest such gap came back warm, or there is no cold one):
  only a cache that went cold with time supports a keep-alive limit. With the longest warm gap and
  the counts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from tokentrace import contract as c
from tokentrace.analyzers.cache import analyze_cache
from tokentrace.analyzers.evidence import Evidence
from tokentrace.analyzers.slowness import analyze_slowness
from tokentrace.collector.stores.store import TraceReader
from tokentrace.errors import NotFound

MAX_TURNS = 200
THRESHOLD_LOOKBACK_NS = 3600 * 1_000_000_000
#: Cache causes that mean the cache lost what an earlier turn left.
LOST = ("capacity", "restart", "instance_change")
#: Of those, the ones a longer gap can bring on a follow-up served where its previous turn was.
TIMED = ("capacity", "restart")
#: Cache verdicts computed per instance to tell a follow-up that came back cold with time from one
#: whose prompt changed (the shortest gaps past the longest warm one first).
MAX_COLD_VERDICTS = 64


@dataclass
class SessionVerdict:
    """The session verdict (schema in the module docstring)."""

    session_id: str
    turns: list[dict[str, Any]]
    cold_turns: list[int]  #: indexes of the turns that came back to a cold cache
    instances: list[dict[str, Any]]  #: per instance: the gap beyond which turns come back cold
    truncated: bool = False  #: more than MAX_TURNS turns: only the latest are shown
    evidence: list[Evidence] = field(default_factory=list)  #: one ``cold_turn`` per cold turn

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict (evidence flattened to {kind, text, ...})."""
        return {**vars(self), "evidence": [e.as_dict() for e in self.evidence]}


def _taken_by(cache: dict) -> dict[str, Any] | None:
    """What took the cache, from a cache verdict whose cause is in LOST."""
    cause = cache["cause"]
    items = {item["kind"]: item for item in cache["evidence"]}
    if cause == "capacity":
        eviction = items.get("eviction") or items.get("no_longer_cached") or {}
        return {"cause": cause, "evicted_by": cache.get("evicted_by"), "evicted_at_ns": eviction.get("evicted_at_ns"),
                "reason": eviction.get("reason"), "entry_request_id": eviction.get("entry_request_id"),
                "text": eviction.get("text")}
    if cause == "instance_change":
        elsewhere = items.get("cached_elsewhere", {})
        return {"cause": cause, "cached_on": cache.get("cached_on"), "moved_to": cache.get("instance_id"),
                "text": elsewhere.get("text")}
    other = next((item for item in cache["evidence"] if item["kind"] != "lookup"), {})
    return {"cause": cause, "text": other.get("text"), "evidence": other}


def _turn(index: int, row: dict, previous: dict | None, reader: TraceReader) -> dict[str, Any]:
    slow = analyze_slowness(reader, row["request_id"]).as_dict()
    cache = analyze_cache(reader, row["request_id"]).as_dict()
    gap = None if previous is None else round((row["start_ns"] - previous["end_ns"]) / 1e6, 3)
    survived, taken = None, None
    if previous is not None and cache["cause"] != "unknown":
        survived = cache["cause"] not in LOST
        taken = None if survived else _taken_by(cache)
    return {
        "turn": index, "request_id": row["request_id"], "instance_id": row["instance_id"],
        "start_ns": row["start_ns"], "end_ns": row["end_ns"], "gap_ms": gap, "ttft_ms": row.get("ttft_ms"),
        "prompt_tokens": row.get("prompt_tokens"), "cached_tokens": row.get("cached_tokens"),
        "completion_tokens": row.get("completion_tokens"),
        "slow": {"category": slow["category"], "ttft_category": slow["ttft_category"], "abnormal": slow["abnormal"]},
        "cache": {"result": cache["result"], "cause": cache["cause"], "seen_tokens": cache["seen_tokens"]},
        "survived": survived, "taken_by": taken,
    }


def once(requests: pl.DataFrame) -> pl.DataFrame:
    """One row per request id (the latest, as ``reader.request`` picks it: a sender may have delivered
    a batch twice), oldest first."""
    return (requests.sort("end_ns").unique("request_id", keep="last", maintain_order=True)
            .sort("start_ns", "request_id"))


def follow_ups(requests: pl.DataFrame, block: int = c.DEFAULT_BLOCK_SIZE) -> list[dict[str, Any]]:
    """Every session's follow-up turns that ran on the instance of their previous turn: gap and warmth."""
    rows = []
    sessions = once(requests.filter(pl.col("session_id").is_not_null()))
    for (_,), turns in sessions.group_by(["session_id"], maintain_order=True):
        ordered = turns.to_dicts()
        for prev, row in itertools.pairwise(ordered):
            if row["instance_id"] != prev["instance_id"]:
                continue
            needed = max(0, (prev["prompt_tokens"] or 0) // block * block - block)
            cached = row["cached_tokens"]
            # warm: True / False by the cached tokens; None when they (or the previous prompt) are unknown
            warm = None if cached is None or prev["prompt_tokens"] is None else cached >= needed and needed > 0
            rows.append({"instance_id": row["instance_id"], "request_id": row["request_id"],
                         "gap_ms": (row["start_ns"] - prev["end_ns"]) / 1e6, "warm": warm})
    return rows


def explain_cold(points: list[dict[str, Any]], cause_of) -> list[dict[str, Any]]:
    """Each point's ``state``: warm, cold (its cache verdict's cause is in TIMED), changed (another
    cause) or unknown; ``cause_of(request_id)`` gives the cause, asked for at most
    MAX_COLD_VERDICTS of the follow-ups that did not come back warm, shortest gaps past the longest
    warm one first (they decide ``cold_after_ms``)."""
    longest_warm = max((p["gap_ms"] for p in points if p["warm"]), default=None)
    misses = sorted((p for p in points if p["warm"] is False),
                    key=lambda p: (longest_warm is not None and p["gap_ms"] <= longest_warm, p["gap_ms"]))
    causes = {p["request_id"]: cause_of(p["request_id"]) for p in misses[:MAX_COLD_VERDICTS]}
    out = []
    for p in points:
        if p["warm"] is None or p["warm"]:
            state = "unknown" if p["warm"] is None else "warm"
        else:
            cause = causes.get(p["request_id"], "unknown")
            # None: everything reusable was reused, the prompt just did not extend the previous one
            state = "cold" if cause in TIMED else "unknown" if cause == "unknown" else "changed"
        out.append({**p, "state": state})
    return out


def cold_threshold(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The shortest gap from which every follow-up that says anything about keep-alive came back
    cold with time (module docstring); ``points`` carry ``state`` (explain_cold)."""
    warm = [p["gap_ms"] for p in points if p["state"] == "warm"]
    cold = [p["gap_ms"] for p in points if p["state"] == "cold"]
    longest_warm = max(warm) if warm else None
    beyond = [g for g in cold if longest_warm is None or g > longest_warm]
    return {"follow_ups": len(points), "warm": len(warm), "cold": len(cold),
            "changed": sum(p["state"] == "changed" for p in points),
            "unknown": sum(p["state"] == "unknown" for p in points),
            "longest_warm_gap_ms": None if longest_warm is None else round(longest_warm, 3),
            "cold_after_ms": round(min(beyond), 3) if beyond else None,
            "cold_at_shorter_gaps": len(cold) - len(beyond)}


def analyze_session(reader: TraceReader, session_id: str) -> SessionVerdict:
    """Load the session's turns and their verdicts; NotFound when no request carries ``session_id``."""
    turns = once(reader.frame("session_requests", session_id=session_id))
    if turns.height == 0:
        raise NotFound(f"no request with session id {session_id!r} in the store")
    truncated = turns.height > MAX_TURNS
    rows = turns.tail(MAX_TURNS).to_dicts()
    result = [_turn(i, row, rows[i - 1] if i else None, reader) for i, row in enumerate(rows)]
    cold = [t["turn"] for t in result if t["survived"] is False]
    since, until = rows[0]["start_ns"] - THRESHOLD_LOOKBACK_NS, rows[-1]["end_ns"] + 1
    instances = []
    for instance in sorted({row["instance_id"] for row in rows if row["instance_id"] is not None}):
        window = reader.requests(since_ns=since, until_ns=until, instance_id=instance, limit=100_000)
        points = explain_cold(follow_ups(window), lambda rid: _cause(reader, rid, result))
        instances.append({"instance_id": instance, **cold_threshold(points)})
    verdict = SessionVerdict(session_id, result, cold, instances, truncated)
    for index in cold:
        turn = result[index]
        taken = turn["taken_by"]
        verdict.evidence.append(Evidence(
            "cold_turn", f"Turn {index} ({turn['request_id']}) came back after a gap of {turn['gap_ms']:,.0f} ms "
                         f"to a cold cache: {_what(taken)}",
            {"turn": index, "request_id": turn["request_id"], "gap_ms": turn["gap_ms"],
             **{k: v for k, v in taken.items() if k != "text"}}))
    return verdict


def _cause(reader: TraceReader, request_id: str, turns: list[dict[str, Any]]) -> str | None:
    """A follow-up's cache cause: this session's turns already have theirs."""
    known = next((t for t in turns if t["request_id"] == request_id), None)
    return known["cache"]["cause"] if known is not None else analyze_cache(reader, request_id).cause


def _what(taken: dict) -> str:
    if taken["cause"] == "capacity":
        by = f"request {taken['evicted_by']}'s insert" if taken.get("evicted_by") else "an eviction outside any insert"
        return f"its entry was evicted ({taken.get('reason') or 'reason unknown'}) by {by}."
    if taken["cause"] == "instance_change":
        moved = taken["moved_to"] if taken["moved_to"] is not None else "an unnamed instance"
        return f"it moved to {moved} while its prefix was cached on {taken['cached_on']}."
    return f"{taken['cause']}: {taken.get('text') or 'no detail'}"
