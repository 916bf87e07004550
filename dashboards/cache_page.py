"""``/cache``: the "global cache capacity" view the field reports say nobody has: per instance, the
prefix cache's bytes and entries against its limits, and how many more sessions of the recent
median session length would fit; evictions over time by reason, token hit rate over time, miss causes.

Capacity estimate, per instance, from its latest heartbeat and the window's requests (the KV budget):
    session bytes   = KV bytes per token x the median session length (``session_length``: per
                      session, its longest prompt + output tokens; a request without a session id
                      is a session of its own)
    more sessions   = min(free bytes / session bytes, free entries)
    sessions in all = min(byte limit / session bytes, entry limit)
Entries bound sessions only where one entry holds one sequence (unit ``entry`` or ``slot``); a
vLLM entry is a KV block (unit ``block``), which the byte figures already cover. Cluster totals add
the instances up: caches are per instance, so one instance's room does not help a session pinned to
another (the field report's "position boundary"); entries are totalled per unit, never across units.

Hit rate against capacity, per instance: the window's latest ``CURVE_REQUESTS`` requests replayed where they were served
at ``CURVE_POINTS`` capacities in tokens evenly spaced up to a little beyond the largest number of
distinct prompt tokens one instance saw, and at the instance's own capacity: every limit its latest
heartbeat declares, its byte limit (as tokens: / KV bytes per token) and, where one entry holds one
sequence (the MLX engine's entries), its entry limit. Each instance is replayed with the cache model
that mirrors it (``whatif``'s ``own`` model, docs/whatif.md: whole entries for the MLX engine,
blocks for vLLM), its entry limit kept at every point of the curve, so that the replay at its own
capacity reproduces the hit rate it achieved on the same requests. An instance that declared no
limit has no figure "at its own capacity" (unknown, not unlimited).
"""

from __future__ import annotations

import time
from typing import Any

import polars as pl
from fastapi import Query, Request

from tokentrace import contract as c
from tokentrace.analyzers.outcome import COMPLETED, outcome_expr
from tokentrace.analyzers.report import reuse_known, token_hit_rate
from tokentrace.analyzers.whatif import Capacity, assign, replay
from tokentrace.analyzers.workload import load_workload
from tokentrace.collector.stores.store import TraceReader
from tokentrace.dashboards import series
from tokentrace.dashboards.causes import window_causes
from tokentrace.dashboards.overview import CAUSE_SAMPLE, LIMIT, thin
from tokentrace.dashboards.web import page
from tokentrace.window import Slice
from tokentrace.window import window_ns as window_of

RECENT_EVICTIONS = 20
CURVE_POINTS = 10
#: The curve replays the window's latest requests only: the page refreshes every few seconds.
CURVE_REQUESTS = 1000


#: Curves computed lately, by the requests they replayed: a live page refreshes every 5 s and
#: replaying is the costly part (about a second for 1,000 long prompts on a busy 2-core machine).
_CURVES: dict[tuple, tuple[float, dict[str, Any]]] = {}
CURVE_TTL_S = 60.0


def capacity_curve(reader: TraceReader, window_ns: int | None, until_ns: int | None = None,
                   where: Slice | None = None) -> dict[str, Any]:
    """Per instance, the token hit ratio the window's traffic (of the slice ``where``) gets at each
    capacity (module docstring)."""
    workload = load_workload(reader, window_ns, until_ns, limit=CURVE_REQUESTS, where=where)
    if not workload.requests:
        return {"chart": {"kind": "line", "x_type": "index", "unit": "pct", "x": [], "series": [],
                          "empty": "no requests with a prompt fingerprint in this window"}, "instances": []}
    key = (len(workload.requests), workload.requests[0].request_id, workload.requests[-1].request_id,
           tuple(sorted((k, v.cache_max_bytes, v.cache_max_entries, v.kv_bytes_per_token, v.cache_unit)
                        for k, v in workload.instances.items())))
    now = time.monotonic()
    cached = _CURVES.get(key)
    if cached is not None and now - cached[0] < CURVE_TTL_S:
        return cached[1]
    curve = _replay_curve(workload)
    for stale in [k for k, (t, _) in _CURVES.items() if now - t >= CURVE_TTL_S]:
        _CURVES.pop(stale, None)
    _CURVES[key] = (now, curve)
    return curve


def _replay_curve(workload) -> dict[str, Any]:
    ids = workload.recorded_ids()
    chosen = assign(workload, len(ids), "recorded")
    distinct = [set() for _ in ids]
    for r, k in zip(workload.requests, chosen, strict=True):
        distinct[k].update(r.blocks)
    need = max(len(blocks) for blocks in distinct) * workload.block_size
    step = max(workload.block_size, -(-need * 6 // 5 // CURVE_POINTS))
    x = [step * (i + 1) for i in range(CURVE_POINTS)]
    runs = [replay(workload, Capacity(tokens=c, own=True), len(ids), "recorded", chosen, "own") for c in x]
    unlimited = replay(workload, Capacity(), len(ids), "recorded", chosen, "own")
    own = Capacity(own=True)
    at_own = replay(workload, own, len(ids), "recorded", chosen, "own")
    rows = []
    for k, name in enumerate(ids):
        mine = at_own["per_instance"][k] if own.known(workload, k) else None
        rows.append({"instance_id": name, "capacity_tokens": mine["capacity_tokens"] if mine else None,
                     "capacity_entries": mine["capacity_entries"] if mine else None,
                     "cache_model": at_own["per_instance"][k]["cache_model"],
                     "token_hit_ratio_at_capacity": mine["token_hit_ratio"] if mine else None,
                     "token_hit_ratio_unlimited": unlimited["per_instance"][k]["token_hit_ratio"],
                     "requests": unlimited["per_instance"][k]["requests"]})
    chart = {"kind": "line", "x_type": "index", "unit": "pct", "x": x, "x_label": "capacity (tokens)",
             "series": [{"name": name, "y": [run["per_instance"][k]["token_hit_ratio"] for run in runs]}
                        for k, name in enumerate(ids)],
             "empty": "no requests with a prompt fingerprint in this window"}
    return {"chart": chart, "instances": rows}

#: Cache units whose entries each hold one sequence, so that free entries bound the sessions that fit.
SEQUENCE_UNITS = (c.UNIT_ENTRY, c.UNIT_SLOT)


def _fit(free: float | None, per_session: float | None) -> int | None:
    if free is None or not per_session:
        return None
    return max(0, int(free // per_session))


def _least(*values: int | None) -> int | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def session_length(requests: pl.DataFrame) -> float | None:
    """The median session length in tokens: per session, its longest context (prompt + output tokens)
    in the window, the latest turn's in a growing conversation; a request without a session id is a
    session of its own. None without requests."""
    if requests.height == 0:
        return None
    context = pl.col("prompt_tokens").fill_null(0) + pl.col("completion_tokens").fill_null(0)
    key = pl.coalesce(pl.lit("s:") + pl.col("session_id"), pl.lit("r:") + pl.col("request_id"))
    per_session = requests.group_by(key.alias("session")).agg(context.max().alias("tokens"))
    return float(per_session["tokens"].median())


def capacity(beat: dict, requests: pl.DataFrame) -> dict[str, Any]:
    """One instance's cache use against its limits and the sessions that fit (module docstring)."""
    mine = requests.filter(pl.col("instance_id") == beat["instance_id"])
    context = session_length(mine)
    per_token, used, limit = beat["kv_bytes_per_token"], beat["cache_bytes"], beat["cache_max_bytes"]
    entries, max_entries = beat["cache_entries"], beat["cache_max_entries"]
    session = per_token * context if per_token and context else None
    free_bytes = max(0, limit - used) if limit is not None and used is not None else None
    free_entries = max(0, max_entries - entries) if max_entries is not None and entries is not None else None
    unit = beat["cache_unit"]
    per_sequence = unit in SEQUENCE_UNITS
    return {
        "instance_id": beat["instance_id"], "heartbeat_ns": beat["t_ns"],
        "bytes": used, "max_bytes": limit,
        "bytes_share": round(used / limit, 4) if limit and used is not None else None,
        "entries": entries, "max_entries": max_entries, "unit": unit,
        "entries_share": round(entries / max_entries, 4) if max_entries and entries is not None else None,
        "kv_bytes_per_token": per_token, "memory_bytes": beat["memory_bytes"],
        "requests": mine.height, "median_session_tokens": None if context is None else round(context, 1),
        "session_bytes": None if session is None else round(session),
        "more_sessions": _least(_fit(free_bytes, session), free_entries if per_sequence else None),
        "sessions_in_all": _least(_fit(limit, session), max_entries if per_sequence else None),
    }


def _total(rows: list[dict], key: str) -> int | None:
    values = [row[key] for row in rows if row[key] is not None]
    return sum(values) if values else None


def entries_by_unit(rows: list[dict]) -> list[dict[str, Any]]:
    """Cache entries and limits added up per unit (an MLX entry and a vLLM block never add up);
    instances that sent no unit (older engines) form their own group, ``unit`` None."""
    groups: dict[str | None, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["unit"], []).append(row)
    return [{"unit": unit, "entries": _total(group, "entries"), "max_entries": _total(group, "max_entries"),
             "instances": len(group)}
            for unit, group in sorted(groups.items(), key=lambda item: item[0] or "")]


def cache_overview(reader: TraceReader, since: str | None, now_ns: int, start: str | None = None,
                   until: str | None = None, where: Slice | None = None) -> dict[str, Any]:
    """Everything the cache page shows for requests and evictions in the last ``since`` (default
    15m), or from ``start`` until ``until``, of the slice ``where``: its requests (one instance,
    model, session or request-id prefix, as the report takes them); evictions, heartbeats and
    capacity belong to instances, so only the instance of a slice narrows them."""
    where = where or Slice()
    window_ns, until_ns = window_of(since, start, until, default_since="15m", now_ns=now_ns,
                                    names=("since", "from", "until"))
    requests = where.keep(reader.requests(since_ns=window_ns, until_ns=until_ns, instance_id=where.instance_id,
                                          limit=LIMIT))
    evictions = reader.frame("evictions_in", since_ns=window_ns, until_ns=until_ns)
    beats = reader.frame("heartbeats_in", since_ns=window_ns, until_ns=until_ns)
    latest = reader.frame("latest_heartbeats")
    if where.instance_id is not None:
        evictions, beats, latest = (frame.filter(pl.col("instance_id") == where.instance_id)
                                    for frame in (evictions, beats, latest))
    rows = [capacity(beat, requests) for beat in latest.to_dicts()]
    end_ns = until_ns if until_ns is not None else now_ns
    t0, t1 = series.span(window_ns, end_ns, [requests["start_ns"], evictions["t_ns"], beats["t_ns"]])
    width = series.step_ns(t0, t1)
    buckets = series.bucket_starts(t0, t1, width)
    by_reason = series.counts_by(evictions, "t_ns", "reason", t0, t1, width)
    # Hit rates and causes count completed requests only (docs/analyzers.md, "Outcome").
    completed = requests.with_columns(outcome_expr().alias("outcome")).filter(pl.col("outcome") == COMPLETED)
    hit, counted = series.ratio(reuse_known(completed), "start_ns", "cached_tokens", "prompt_tokens", t0, t1, width)
    causes, sampled = window_causes(reader, completed, CAUSE_SAMPLE)
    curve = capacity_curve(reader, window_ns, until_ns, where)
    fill = []
    for (instance,), group in beats.group_by(["instance_id"], maintain_order=True):
        group = thin(group.filter(pl.col("cache_max_bytes") > 0))
        fill.append({"name": instance, "x": (group["t_ns"] / 1e6).to_list(),
                     "y": (group["cache_bytes"] / group["cache_max_bytes"]).round(4).to_list()})
    used, limit = _total(rows, "bytes"), _total(rows, "max_bytes")
    return {
        "window": {"since": since, "since_ns": window_ns, "until_ns": until_ns, "now_ns": now_ns,
                   "from": start, "until": until},
        "slice": where.params(),
        "instances": rows,
        "cluster": {"bytes": used, "max_bytes": limit,
                    "bytes_share": round(used / limit, 4) if used is not None and limit else None,
                    "entries": entries_by_unit(rows),
                    "more_sessions": _total(rows, "more_sessions"), "sessions_in_all": _total(rows, "sessions_in_all")},
        "evictions": {"total": evictions.height, "by_reason": dict(sorted(
            evictions.group_by("reason").len().iter_rows())) if evictions.height else {},
            "recent": evictions.tail(RECENT_EVICTIONS).reverse().to_dicts()},
        "hit_rate": {"token_hit_rate": token_hit_rate(completed), "t": buckets, "rate": hit, "requests": counted},
        "causes": causes, "cause_sample": sampled,
        "capacity_curve": curve["instances"],
        "charts": {
            "capacity_curve": curve["chart"],
            "fill": {"kind": "line", "x_type": "time", "unit": "pct", "series": fill,
                     "hline": {"name": "limit", "value": 1},
                     "x_min": t0 / 1e6, "x_max": t1 / 1e6,
                     "empty": "no heartbeats in this window"},
            "evictions": {"kind": "bars", "x_type": "time", "unit": "count", "x": buckets,
                          "series": [{"name": k, "y": v} for k, v in by_reason.items()],
                          "empty": "no evictions in this window"},
            "hit_rate": {"kind": "line", "x_type": "time", "unit": "pct", "x": buckets,
                         "series": [{"name": "prompt tokens from cache", "y": hit}],
                         "empty": "no requests in this window"},
        },
        "bucket_s": width / 1e9,
    }


@page("/cache", "cache.html", "Cache")
def cache_page(request: Request, since: str | None = None, start: str | None = Query(None, alias="from"),
               until: str | None = None, instance: str | None = None, model: str | None = None,
               session: str | None = None, request_prefix: str | None = None) -> dict[str, Any]:
    """The cache page and its twin ``/cache.json`` (a window and a slice as ``/api/report`` takes them)."""
    return cache_overview(request.app.state.reader, since, time.time_ns(), start, until,
                          Slice(instance, model, session, request_prefix))
