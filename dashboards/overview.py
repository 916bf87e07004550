"""``/``: the window at a glance. Latency percentiles over every instance (both TTFTs, named: time
to first token, the engine's, and time to first content, the client's), output tokens/s,
requests per slowness category, cache reuse and miss causes (from the analyzers' window report),
attainment of the collector's service-level objectives (``--slo``) and goodput,
queue depth over time from heartbeats, each instance's health, and the requests that did not
complete (rejected, failed, cancelled: the newest, with what they were answered).
"""

from __future__ import annotations

import time
from typing import Any

import polars as pl
from fastapi import Query, Request

from tokentrace.analyzers.outcome import COMPLETED, OUTCOMES, UNDECOMPOSED
from tokentrace.analyzers.report import (
    declared_parts,
    percentiles,
    summarize_frame,
    with_categories,
    with_first_content,
)
from tokentrace.analyzers.slo import SloSpec
from tokentrace.analyzers.slowness import CATEGORIES
from tokentrace.collector.stores.store import TraceReader
from tokentrace.dashboards import series
from tokentrace.dashboards.advice_page import remembered_advice
from tokentrace.dashboards.causes import window_causes
from tokentrace.dashboards.instances import instance_health
from tokentrace.dashboards.web import page
from tokentrace.window import Slice
from tokentrace.window import window_ns as window_of

#: Requests whose cache cause is computed (one cache verdict each), the latest of the window.
CAUSE_SAMPLE = 30
#: Pieces of advice on the overview's panel (the best; the advice page has them all).
ADVICE_SHOWN = 3
#: Heartbeats kept per instance on the queue chart; older points are thinned evenly beyond this.
MAX_POINTS = 600
LIMIT = 1_000_000
#: Requests that did not complete listed on the page (the newest first); their count is in outcomes.
NOT_COMPLETED_LISTED = 50
#: The latency percentiles shown: (column, label, what it measures). Both TTFTs, each named.
LATENCY = (
    ("ttft_ms", "time to first token (engine)", "arrival to the first token the engine generated"),
    ("first_content_ms", "time to first content (client)",
     "arrival to the first response chunk carrying answer text: the TTFT a client (aiperf, a browser) measures"),
    ("tpot_ms", "time per output token", "mean time between output tokens"),
    ("e2e_ms", "end to end", "arrival to the last byte"),
)


def thin(rows: pl.DataFrame, max_points: int = MAX_POINTS) -> pl.DataFrame:
    """Every k-th row so that at most ``max_points`` remain (the newest is always kept)."""
    if rows.height <= max_points:
        return rows
    k = -(-rows.height // max_points)
    return rows.reverse().gather_every(k).reverse()


def queue_series(beats: pl.DataFrame) -> list[dict[str, Any]]:
    """Per instance: heartbeat times (epoch ms), queue depth and running sequences."""
    lines = []
    for (instance,), rows in beats.group_by(["instance_id"], maintain_order=True):
        rows = thin(rows)
        lines.append({"instance_id": instance, "t": (rows["t_ns"] / 1e6).to_list(),
                      "queue_depth": rows["queue_depth"].to_list(), "running": rows["running"].to_list()})
    return lines


def overview(reader: TraceReader, since: str | None, now_ns: int, slo: SloSpec | None = None,
             start: str | None = None, until: str | None = None, where: Slice | None = None) -> dict[str, Any]:
    """The overview of requests that started in the last ``since`` (default 15m), or from ``start``
    until ``until``, of the slice ``where`` (one instance, model, session or request-id prefix; the
    report's: docs/analyzers.md), with SLO attainment with ``slo``."""
    where = where or Slice()
    window_ns, until_ns = window_of(since, start, until, default_since="15m", now_ns=now_ns,
                                    names=("since", "from", "until"))
    frame = where.keep(reader.requests(since_ns=window_ns, until_ns=until_ns, instance_id=where.instance_id,
                                   limit=LIMIT))
    frame = with_categories(frame, declared_parts(reader))
    report = summarize_frame(reader, frame, window_ns, until_ns, cause_sample=0, slo=slo, where=where).as_dict()
    causes, sampled = window_causes(reader, frame, CAUSE_SAMPLE)
    latency: dict[str, Any] = {name: {"p50": None, "p95": None, "p99": None} for name, _, _ in LATENCY}
    throughput = {"output_tokens": 0, "input_tokens": 0, "output_tokens_per_s": None, "active_s": None}
    errors = 0
    not_completed: list[dict[str, Any]] = []
    if frame.height:
        failed = frame.filter(pl.col("outcome") != COMPLETED).sort("start_ns", descending=True)
        not_completed = failed.head(NOT_COMPLETED_LISTED).select(
            "request_id", "instance_id", "outcome", "start_ns", "http_status", "error_type", "finish_reason",
            "client_disconnected").to_dicts()
        # the report's rule: latency of completed only
        completed = with_first_content(frame.filter(pl.col("outcome") == COMPLETED))
        latency = {name: percentiles(completed[name]) for name in latency}
        active_s = max(1e-9, (frame["end_ns"].max() - frame["start_ns"].min()) / 1e9)
        output = int(frame["completion_tokens"].fill_null(0).sum())
        throughput = {"output_tokens": output, "input_tokens": int(frame["prompt_tokens"].fill_null(0).sum()),
                      "output_tokens_per_s": round(output / active_s, 2), "active_s": round(active_s, 3)}
        errors = int(frame.filter((pl.col("http_status").fill_null(200) >= 400)
                                  | pl.col("error_type").is_not_null()).height)
    categories = {label: report["categories"].get(label, 0) for label in [*(label for _, label in CATEGORIES),
                                                                           UNDECOMPOSED]}
    outcomes = {name: report["outcomes"].get(name, 0) for name in OUTCOMES}
    beats = reader.frame("heartbeats_in", since_ns=window_ns, until_ns=until_ns)
    health = instance_health(reader, now_ns)
    if where.instance_id is not None:
        beats = beats.filter(pl.col("instance_id") == where.instance_id)
        health = [row for row in health if row["instance_id"] == where.instance_id]
    queue = queue_series(beats)
    chart_end = until_ns if until_ns is not None else now_ns
    chart_t0, _ = series.span(window_ns, chart_end, [beats["t_ns"]])
    latency_of = {row["instance_id"]: row for row in report["instances"]}
    known = {row["instance_id"] for row in health}
    # One row per instance: its health, and its latency over the window when it served requests.
    instances = [{**row, "latency": latency_of.get(row["instance_id"])} for row in health]
    instances += [{"instance_id": i, "status": "unknown", "stage": "unknown", "heartbeat": None, "live": False,
                   "now": None, "latency": row}
                  for i, row in latency_of.items() if i not in known]
    advice = {**remembered_advice(reader, since, start, until, where, slo, CAUSE_SAMPLE), "shown": ADVICE_SHOWN}
    return {
        "advice": advice,
        "window": {"since": since, "since_ns": window_ns, "until_ns": until_ns, "now_ns": now_ns,
                   "from": start, "until": until},
        "slice": where.params(),
        "requests": report["requests"], "errors": errors, "outcomes": outcomes, "latency": latency,
        "latency_labels": LATENCY,
        "throughput": throughput,
        "categories": categories,
        "category_share": {k: round(v / outcomes[COMPLETED], 4) if outcomes[COMPLETED] else 0.0
                           for k, v in categories.items()},
        "cache": {"requests_with_reuse": 0, "requests_without_reuse": 0, **report["cache"]},
        "causes": causes, "cause_sample": sampled, "instances": instances,
        "slowest": report["slowest"], "not_completed": not_completed, "store_losses": store_losses(reader),
        "queue": queue, "slo": report["slo"], "routing": report["routing"],
        "charts": {"queue": {"kind": "line", "x_type": "time", "unit": "count", "x_min": chart_t0 / 1e6,
                             "x_max": chart_end / 1e6,
                             "series": [{"name": s["instance_id"], "x": s["t"], "y": s["queue_depth"]}
                                        for s in queue],
                             "empty": "no heartbeats in this window"}},
    }


#: Quarantine entries the overview lists (the newest); /metrics counts them all.
LOSSES_LISTED = 20


def store_losses(reader: TraceReader) -> dict[str, Any] | None:
    """What the store set aside and lost (its quarantine, ``DuckDBStore.losses``): the count and the
    newest entries with what each held; None for a store that keeps no quarantine (ClickHouse)."""
    losses = getattr(reader, "losses", None)
    if losses is None:
        return None
    entries = losses()
    shown = []
    for entry in reversed(entries[-LOSSES_LISTED:]):
        lost = entry.get("acknowledged_spans_lost")
        shown.append({"kind": entry.get("kind"), "at_ns": entry.get("at_ns"), "file": entry.get("file"),
                      "why": entry.get("why"), "note": entry.get("note"),
                      "records": None if entry.get("first_seq") is None else
                      [entry.get("first_seq"), entry.get("last_seq")],
                      "lost": bool(entry.get("acknowledged_batches_lost") or lost), "spans_lost": lost})
    return {"entries": len(entries), "shown": shown}


@page("/", "overview.html", "Overview")
def overview_page(request: Request, since: str | None = None, start: str | None = Query(None, alias="from"),
                  until: str | None = None, instance: str | None = None, model: str | None = None,
                  session: str | None = None, request_prefix: str | None = None) -> dict[str, Any]:
    """The overview page and its twin ``/.json`` (a window and a slice as ``/api/report`` takes them)."""
    collector = getattr(request.app.state, "collector", None)
    slo = getattr(collector.config, "slo", None) if collector is not None else None
    return overview(request.app.state.reader, since, time.time_ns(), slo, start, until,
                    Slice(instance, model, session, request_prefix))
