"""``/timeline``: one lane per instance; each request a bar split into load_wait, queue, prefill
(its chunks) and decode; evictions and model loads as markers. A distributed instance (issue 46) is
one lane whatever its ranks (the ranks above 0 report as ``<instance>/rank<r>``; their loads are
the lane's, drawn on their node's row); ``open=<instance>`` opens it into its nodes: one row per
rank with that rank's engine steps, each timed one split into compute, ring wait and the rest.

The page is a canvas renderer (static/timeline.js) that fetches the twin ``/timeline.json``. The
twin is columnar (one array per field, times in ms from ``t0_ns``) so that 10,000 requests are a
few hundred kilobytes that the browser parses in milliseconds; the page draws them without 10,000
DOM nodes. Phase boundaries come from each request row's phase summary (start + load_wait + queue
+ prefill + decode), the same numbers the slowness verdict uses. Each request also carries the
verdict's abnormal test (``analyzers.baseline``: its category's component against its instance's
own baseline), null where the verdict could not judge it.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import polars as pl
from fastapi import Query, Request

from tokentrace.analyzers.baseline import history_of, judge_abnormal
from tokentrace.analyzers.outcome import COMPLETED, OUTCOMES, UNDECOMPOSED
from tokentrace.analyzers.report import declared_parts, with_categories, with_first_content
from tokentrace.analyzers.slo import SloSpec, judge
from tokentrace.analyzers.slowness import CATEGORIES
from tokentrace.collector.stores.store import TraceReader
from tokentrace.dashboards.nodes import node_list
from tokentrace.dashboards.web import page
from tokentrace.window import Slice
from tokentrace.window import window_ns as window_of

PHASES = ("load_wait", "queue", "prefill", "decode")
#: What a request's colour says: its category when it completed, else its outcome.
LABELS = (*(label for _, label in CATEGORIES), UNDECOMPOSED, *(o for o in OUTCOMES if o != COMPLETED))
#: Most requests one timeline holds (the newest); the twin says when it cut.
MAX_REQUESTS = 20_000
#: Most engine steps the nodes of one opened instance draw (the newest); the twin says when it cut.
MAX_NODE_STEPS = 200_000


def _ms(column: str, t0_ns: int) -> pl.Expr:
    """Epoch ns -> ms from t0, to the microsecond."""
    return ((pl.col(column) - t0_ns) / 1e6).round(3)


def _requests(frame: pl.DataFrame, lanes: dict[str, int], t0_ns: int, slo: SloSpec | None,
              abnormal: pl.DataFrame) -> dict[str, list]:
    codes = {label: i for i, label in enumerate(LABELS)}
    if slo is not None:  # per request, the objectives it missed (analyzers.slo.judge: the report's rule)
        judged = judge(with_first_content(frame), slo)
        names = slo.names()
        missed = pl.concat_list([pl.when(pl.col(f"slo_{name}").not_().fill_null(False)).then(pl.lit(name))
                                 for name in names]).list.drop_nulls()
        frame = judged.with_columns(pl.when(missed.list.len() > 0).then(missed.list.join(","))
                                    .alias("slo_missed"))
    else:
        frame = frame.with_columns(pl.lit(None, dtype=pl.String).alias("slo_missed"))
    cols = frame.select(
        pl.col("request_id").alias("id"),
        pl.col("instance_id").fill_null("").replace_strict(lanes, return_dtype=pl.Int32).alias("lane"),
        _ms("start_ns", t0_ns).alias("start"),
        _ms("end_ns", t0_ns).alias("end"),
        *[pl.col(f"{name}_ms").round(3).alias(name) for name in PHASES],  # null: unknown, never 0
        pl.coalesce("category", "outcome").replace_strict(codes, return_dtype=pl.Int8).alias("category"),
        pl.col("ttft_ms").round(3).alias("ttft"), pl.col("tpot_ms").round(3).alias("tpot"),
        pl.col("e2e_ms").round(3).alias("e2e"),
        pl.col("prompt_tokens").alias("prompt"), pl.col("cached_tokens").alias("cached"),
        pl.col("completion_tokens").alias("completion"), pl.col("http_status").alias("status"),
        pl.col("slo_missed"),  # "ttft,tpot": the objectives missed; null: none missed, or no --slo
    )
    # abnormal: true/false, null when not judged; observed and baseline: the compared metric (the
    # category's), samples: the comparable requests (null: the category names no component).
    cols = pl.concat([cols, abnormal], how="horizontal")
    return {name: cols[name].to_list() for name in cols.columns}


def _chunks(reader: TraceReader, rows: dict[str, int], window_ns: int | None, t0_ns: int) -> dict[str, list]:
    chunks = reader.bulk("prefill_chunks_in", since_ns=window_ns, until_ns=None)
    chunks = chunks.filter(pl.col("request_id").is_in(list(rows)))
    chunks = chunks.select(pl.col("request_id").replace_strict(rows, return_dtype=pl.Int32).alias("request"),
                           _ms("start_ns", t0_ns).alias("start"), _ms("end_ns", t0_ns).alias("end"),
                           pl.col("tokens"))
    return {name: chunks[name].to_list() for name in chunks.columns}


def _markers(evictions: pl.DataFrame, loads: pl.DataFrame, lanes: dict[str, int], t0_ns: int,
             nodes: dict[str, tuple[str, int]]) -> dict[str, Any]:
    """Evictions and loads on their lanes. A rank above 0's load is its instance's lane's, with its
    node's row (``node``; null: the lane's own); its evictions replay rank 0's and are not drawn."""
    evictions = evictions.filter(pl.col("instance_id").is_in(list(lanes)))
    loads = loads.filter(pl.col("instance_id").is_in([*lanes, *nodes]))
    loads = loads.unique("load_id", keep="first", maintain_order=True)
    return {
        "evictions": {
            "lane": [lanes[i] for i in evictions["instance_id"].to_list()],
            "t": evictions.select(_ms("t_ns", t0_ns))["t_ns"].to_list(),
            "reason": evictions["reason"].to_list(), "tokens": evictions["tokens"].to_list(),
            "bytes": evictions["bytes"].to_list(), "entry_request": evictions["entry_request_id"].to_list(),
            "by_request": evictions["evicted_by_request_id"].to_list(),
        },
        "loads": {
            "lane": [lanes[nodes[i][0]] if i in nodes else lanes[i] for i in loads["instance_id"].to_list()],
            "node": [nodes[i][1] if i in nodes else None for i in loads["instance_id"].to_list()],
            "start": loads.select(_ms("start_ns", t0_ns))["start_ns"].to_list(),
            "end": loads.select(_ms("end_ns", t0_ns))["end_ns"].to_list(),
            "load_id": loads["load_id"].to_list(), "lazy": loads["lazy"].to_list(),
        },
    }


def _node_rows(clusters: dict[str, list[dict]], lanes: dict[str, int]) -> tuple[dict[str, list], dict[str, int]]:
    """One row per node of each distributed lane, lane by lane in ring order, and each node's row by
    its own instance id."""
    rows: dict[str, list] = {"lane": [], "rank": [], "name": [], "host": [], "placement": []}
    index: dict[str, int] = {}
    for name, lane in lanes.items():
        for node in clusters.get(name, ()):
            index[node["instance_id"]] = len(rows["lane"])
            for key, value in (("lane", lane), ("rank", node["rank"]), ("name", node["instance_id"]),
                               ("host", node["host"]), ("placement", node["placement"])):
                rows[key].append(value)
    return rows, index


def _node_steps(reader: TraceReader, opened: list[str], rows: dict[str, int], window_ns: int | None,
                until_ns: int | None, t0_ns: int) -> dict[str, Any]:
    """The engine steps of the opened instances' nodes: per step its node's row, start and end, and
    for a step the rank timed, its compute and ring wait (ms; null: not timed)."""
    frames, truncated = [], False
    for name in opened:
        frame = reader.frame("node_steps_in", since_ns=window_ns, until_ns=until_ns, instance_id=name,
                             limit=MAX_NODE_STEPS + 1)
        truncated |= frame.height > MAX_NODE_STEPS
        frames.append(frame.head(MAX_NODE_STEPS))
    steps = pl.concat(frames) if frames else pl.DataFrame(schema={
        "instance_id": pl.String, "start_ns": pl.Int64, "duration_ns": pl.Int64, "compute_ns": pl.Int64,
        "ring_wait_ns": pl.Int64})
    steps = steps.filter(pl.col("instance_id").is_in(list(rows)))
    steps = steps.select(
        pl.col("instance_id").replace_strict(rows, return_dtype=pl.Int32).alias("node"),
        _ms("start_ns", t0_ns).alias("start"),
        ((pl.col("start_ns") + pl.col("duration_ns") - t0_ns) / 1e6).round(3).alias("end"),
        (pl.col("compute_ns") / 1e6).round(3).alias("compute"), (pl.col("ring_wait_ns") / 1e6).round(3).alias("ring"),
    ).sort("node", "start")
    return {"steps": {name: steps[name].to_list() for name in steps.columns}, "steps_truncated": truncated}


def timeline(reader: TraceReader, since: str | None, now_ns: int, limit: int = MAX_REQUESTS,
             slo: SloSpec | None = None, start: str | None = None, until: str | None = None,
             where: Slice | None = None, opened: list[str] | None = None) -> dict[str, Any]:
    """The columnar timeline of requests that started in the last ``since`` (default 15m), or from
    ``start`` until ``until``, of the slice ``where`` (with ``slo``: the objectives each one missed),
    with the distributed instances named in ``opened`` opened into their nodes."""
    where = where or Slice()
    window_ns, until_ns = window_of(since, start, until, default_since="15m", now_ns=now_ns,
                                    names=("since", "from", "until"))
    window = reader.requests(since_ns=window_ns, until_ns=until_ns, instance_id=where.instance_id, limit=limit + 1)
    frame = where.keep(window)
    truncated = frame.height > limit
    stored = frame.tail(limit)
    frame = with_categories(stored, declared_parts(reader))
    # Judged on the rows as stored (the verdict's own inputs), against every request of their
    # instances, whatever the slice.
    abnormal = judge_abnormal(stored.with_columns(frame["category"]), history_of(reader, stored, window))
    evictions = reader.frame("evictions_in", since_ns=window_ns, until_ns=until_ns)
    loads = reader.frame("loads_in", since_ns=window_ns, until_ns=until_ns)
    if where.instance_id is not None:
        evictions = evictions.filter(pl.col("instance_id") == where.instance_id)
        loads = loads.filter((pl.col("instance_id") == where.instance_id)
                             | pl.col("instance_id").str.starts_with(where.instance_id + "/rank"))
    clusters = node_list(reader)
    #: a rank above 0 of a distributed instance -> that instance: not a lane of its own
    node_of = {n["instance_id"]: of for of, nodes in clusters.items() for n in nodes if n["instance_id"] != of}
    instances = set(frame["instance_id"].fill_null("").to_list())
    for markers in (evictions, loads):
        instances |= set(markers["instance_id"].drop_nulls().to_list())
    lanes = {instance: i for i, instance in enumerate(sorted({node_of.get(i, i) for i in instances}))}
    nodes, node_row = _node_rows(clusters, lanes)
    opened = [name for name in dict.fromkeys(opened or ()) if name in lanes and name in clusters]
    t0_ns = window_ns if window_ns is not None else (frame["start_ns"].min() if frame.height else now_ns)
    rows = {rid: i for i, rid in enumerate(frame["request_id"].to_list())}
    return {
        "window": {"since": since, "since_ns": window_ns, "until_ns": until_ns, "now_ns": now_ns},
        "slice": where.params(),
        "t0_ns": t0_ns, "now": round((now_ns - t0_ns) / 1e6, 3), "unit": "ms",
        "lanes": list(lanes), "phases": list(PHASES), "categories": list(LABELS),
        "count": frame.height, "truncated": truncated,
        "slo": None if slo is None else slo.text,
        "requests": _requests(frame, lanes, t0_ns, slo, abnormal),
        "chunks": _chunks(reader, rows, window_ns, t0_ns),
        **_markers(evictions, loads, lanes, t0_ns,
                   {name: (of, node_row[name]) for name, of in node_of.items() if of in lanes}),
        #: every distributed lane's nodes (a lane with nodes can be opened), the lanes opened, their steps
        "nodes": nodes, "open": opened,
        **_node_steps(reader, opened, {name: row for name, row in node_row.items()
                                       if nodes["lane"][row] in {lanes[o] for o in opened}},
                      window_ns, until_ns, t0_ns),
    }


@page("/timeline", "timeline.html", "Timeline")
def timeline_page(request: Request, since: str | None = None, start: str | None = Query(None, alias="from"),
                  until: str | None = None, instance: str | None = None, model: str | None = None,
                  session: str | None = None, request_prefix: str | None = None,
                  opened: Annotated[list[str] | None, Query(alias="open")] = None) -> dict[str, Any]:
    """The timeline page (a canvas that loads ``/timeline.json``) and the twin itself (a window and a
    slice as the overview takes them; ``open``, repeated: the distributed instances opened into
    their nodes)."""
    collector = getattr(request.app.state, "collector", None)
    slo = getattr(collector.config, "slo", None) if collector is not None else None
    return timeline(request.app.state.reader, since, time.time_ns(), slo=slo, start=start, until=until,
                    where=Slice(instance, model, session, request_prefix), opened=opened)
