"""``/requests/{id}``: one request. The waterfall of its spans, both verdicts with their evidence,
the requests that shared engine steps with it, its inter-token latency, and its prompt segments
(with snippets when the engine captured content).

An unknown id is a 404 page, and a 404 JSON envelope on the twin.
"""

from __future__ import annotations

import json
from typing import Any

import polars as pl
from fastapi import Request

from tokentrace.analyzers.cache import analyze_cache, request_window
from tokentrace.analyzers.slo import SloSpec, missed_objectives
from tokentrace.analyzers.slowness import classify_slowness, load_slow_facts, rank_split
from tokentrace.collector.stores.store import TraceReader
from tokentrace.dashboards.web import page

PHASES = ("load_wait", "queue", "prefill", "decode", "other")
#: Attributes not worth a waterfall row's space (the request id is on every span).
_SKIP = {"tokentrace.request.id"}
_MAX_DETAIL = 4
#: Waterfall bar colour (a CSS class) per span name; others are grey.
_CSS = {"llm.load_wait": "c-load_wait", "llm.queue": "c-queue", "llm.prefill": "c-prefill",
        "llm.prefill.chunk": "c-prefill", "llm.decode": "c-decode"}


def _detail(attributes: str | None) -> str:
    """A few scalar attributes of a span, 'key=value' without the namespace."""
    try:
        values = json.loads(attributes or "{}")
    except ValueError:
        return ""
    parts = [f"{key.removeprefix('tokentrace.').removeprefix('gen_ai.')}="
             f"{round(value, 3) if isinstance(value, float) else value}" for key, value in values.items()
             if key not in _SKIP and not isinstance(value, (list, dict))]
    return " · ".join(parts[:_MAX_DETAIL])


def waterfall(spans: pl.DataFrame) -> list[dict[str, Any]]:
    """Spans of a trace in tree order (parents before children), with offsets and CSS shares."""
    if spans.height == 0:
        return []
    rows = spans.to_dicts()
    t0 = min(r["start_ns"] for r in rows)
    total = max(1, max(r["end_ns"] for r in rows) - t0)
    children: dict[str | None, list[dict]] = {}
    ids = {r["span_id"] for r in rows}
    for r in rows:
        parent = r["parent_span_id"] if r["parent_span_id"] in ids else None
        children.setdefault(parent, []).append(r)
    ordered: list[dict[str, Any]] = []

    def visit(parent: str | None, depth: int) -> None:
        for r in sorted(children.get(parent, []), key=lambda s: (s["start_ns"], s["name"])):
            ordered.append({
                "name": r["name"], "span_id": r["span_id"], "depth": depth,
                "offset_ms": round((r["start_ns"] - t0) / 1e6, 3), "ms": round((r["end_ns"] - r["start_ns"]) / 1e6, 3),
                "left": round((r["start_ns"] - t0) / total, 5),
                "width": round((r["end_ns"] - r["start_ns"]) / total, 5),
                "status_code": r["status_code"], "detail": _detail(r["attributes"]), "css": _CSS.get(r["name"], ""),
            })
            visit(r["span_id"], depth + 1)

    visit(None, 0)
    return ordered


def inter_token(steps: pl.DataFrame) -> dict[str, Any]:
    """Per generated token after the first: its index, when (ms after the first token) and its ITL."""
    if steps.height < 2:
        return {"token": [], "t_ms": [], "itl_ms": [], "p50": None, "p90": None, "max": None}
    t = steps["t_ns"]
    itl = (t.diff().slice(1) / 1e6).round(3)
    return {"token": steps["step"].slice(1).to_list(), "t_ms": ((t.slice(1) - t[0]) / 1e6).round(3).to_list(),
            "itl_ms": itl.to_list(), "p50": round(float(itl.quantile(0.5, "nearest")), 3),
            "p90": round(float(itl.quantile(0.9, "nearest")), 3), "max": round(float(itl.max()), 3)}


def request_detail(reader: TraceReader, request_id: str, slo: SloSpec | None = None) -> dict[str, Any]:
    """Everything the request page shows; NotFound for an unknown id. With objectives (the
    collector's --slo), the slowness verdict says which of them the request missed."""
    facts = load_slow_facts(reader, request_id)  # NotFound here when the store has no such request
    request_id = facts.request["request_id"]  # the request's own id, should an alias have been given
    slow = classify_slowness(facts)
    slow.slo_missed = missed_objectives(facts.request, slo)
    # The slowness facts carry the cache verdict only for prefill-bound requests; the page shows both.
    cache = facts.cache or analyze_cache(reader, request_id)
    row = facts.request
    e2e = slow.breakdown_ms["e2e"] or 0.0
    batched = reader.frame("batched_with", instance_id=row["instance_id"], request_id=request_id,
                           t0_ns=row["start_ns"], t1_ns=row["end_ns"])
    window = request_window(row)  # per-request reads are bounded by its own time span
    itl = inter_token(reader.frame("decode_steps_of", request_id=request_id, **window))
    return {
        "request": row,
        "e2e_ms": e2e,
        "split": [{"phase": p, "ms": slow.breakdown_ms[p], "share": round((slow.breakdown_ms[p] or 0) / e2e, 5)
                   if e2e else 0.0} for p in PHASES],
        "slow": slow.as_dict(),
        "slo": None if slo is None else {"spec": slo.text, "objectives": slo.objectives_for(row.get("model"),
                                                                                           row.get("instance_id"))},
        "cache": cache.as_dict(),
        "spans": waterfall(reader.trace(row["trace_id"])),
        "batched_with": batched.to_dicts(),
        "itl": itl,
        "segments": reader.frame("segments_of", request_id=request_id, **window).to_dicts(),
        #: a distributed instance: per phase, each rank's mean timed step while this request was in it
        "nodes": {phase: ranks for phase in ("prefill", "decode")
                  if (ranks := rank_split(row["instance_id"], facts.nodes, phase))},
        "charts": {"itl": {"kind": "line", "x_type": "index", "unit": "ms", "x": itl["token"],
                           "series": [{"name": "inter-token latency", "y": itl["itl_ms"]}],
                           "empty": "fewer than two tokens: no inter-token latency"}},
    }


@page("/requests/{request_id:path}", "request.html", "Request")
def request_page(request: Request, request_id: str) -> dict[str, Any]:
    """One request's page and its twin ``/requests/{id}.json``."""
    collector = getattr(request.app.state, "collector", None)
    slo = getattr(collector.config, "slo", None) if collector is not None else None
    return request_detail(request.app.state.reader, request_id, slo)
