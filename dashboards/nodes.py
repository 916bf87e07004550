"""A distributed instance's nodes (issue 46): what the instances page and ``/instances.json`` show of
an engine that runs as N ranks of one instance (rank 0 serves the API and is the instance itself;
the ranks above it report as ``<instance>/rank<r>``, each from its own process).

Per node, in ring order (by rank): its host, what it holds (``model.load.shard``'s placement), its
weight bytes, the bytes its prompt cache holds (its share of the KV: in pipeline placement each rank
holds its own layers' KV), the memory MLX holds there and the memory the node can still give it
(``tokentrace.memory.free``), how many more tokens and sessions of the instance's median session
length would fit in that free memory (``sessions = free / (its KV bytes per token x median session
tokens)``), its load (the slowest stage), whether it is up, and its time over the last
``ACTIVITY_S`` seconds split into compute (its layers), ring (waiting on the other ranks), the rest
of a step (embedding, head, sampling, the hand-over) and idle:

    busy    = the node's step time in a bucket / the bucket's length
    compute = busy x (its compute / its step time, over the steps it timed: one in 8)
    ring    = busy x (its ring waits / its step time, over the same steps)
    rest    = busy - compute - ring;  idle = 1 - busy

A node that timed no step in a bucket (tensor placement, whose communication is inside every layer,
or a bucket without a timed step) has busy and idle only. The node whose free memory holds the fewest
tokens binds the instance: a session needs room on every node.
"""

from __future__ import annotations

import json
from typing import Any

import polars as pl

from tokentrace import contract as c
from tokentrace.collector.stores.store import TraceReader

#: The stretch of each node's time split shown (the last ten minutes), in node_activity.sql's buckets.
ACTIVITY_S = 600
BUCKET_NS = 10_000_000_000
#: The requests whose median session length sizes a session: the instance's over the last hour.
SESSION_WINDOW_NS = 3600 * 10**9
SESSION_REQUESTS = 100_000
PARTS = ("compute", "ring", "rest", "idle")


def _attributes(text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def node_of(resource_attributes: str | None) -> tuple[str, int] | None:
    """(the instance it is a node of, its rank) from a distributed engine's rank's resource
    attributes (JSON); None for anything else."""
    if not resource_attributes or c.NODE_OF not in resource_attributes:
        return None
    attrs = _attributes(resource_attributes)
    of, rank = attrs.get(c.NODE_OF), _int(attrs.get(c.NODE_RANK))
    return (of, rank) if isinstance(of, str) and rank is not None else None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _share(part: float, whole: float) -> float:
    return round(min(max(part / whole, 0.0), 1.0), 4) if whole > 0 else 0.0


def _split(bucket: dict[str, Any], length_ns: int) -> dict[str, float | None]:
    """One node's time in one bucket, as shares of the bucket (module docstring)."""
    busy = _share(bucket["step_sum_ns"] or 0, length_ns)
    timed = bucket["timed_sum_ns"] or 0
    if not timed:
        return {"busy": busy, "compute": None, "ring": None, "rest": None, "idle": round(1 - busy, 4)}
    compute = round(busy * _share(bucket["compute_sum_ns"] or 0, timed), 4)
    ring = round(min(busy * _share(bucket["ring_wait_sum_ns"] or 0, timed), busy - compute), 4)
    return {"busy": busy, "compute": compute, "ring": ring, "rest": round(max(busy - compute - ring, 0.0), 4),
            "idle": round(1 - busy, 4)}


def activity(rows: list[dict[str, Any]], since_ns: int, now_ns: int) -> dict[str, Any]:
    """A node's time split over [since_ns, now_ns]: per bucket (a chart's series) and in all."""
    by_bucket = {row["bucket_ns"]: row for row in rows}
    x, series = [], {part: [] for part in PARTS}
    totals = {"steps": 0, "timed_steps": 0, "step_sum_ns": 0, "timed_sum_ns": 0, "compute_sum_ns": 0,
              "ring_wait_sum_ns": 0}
    for start in range(since_ns, now_ns, BUCKET_NS):
        length = min(BUCKET_NS, now_ns - start)
        row = by_bucket.get(start)
        split = _split(row, length) if row else {"busy": 0.0, "compute": None, "ring": None, "rest": None,
                                                   "idle": 1.0}
        x.append(start / 1e6)
        if split["compute"] is None:  # not split: its busy time is all "rest" of a step, said as such
            series["compute"].append(None)
            series["ring"].append(None)
            series["rest"].append(split["busy"])
        else:
            for part in ("compute", "ring", "rest"):
                series[part].append(split[part])
        series["idle"].append(split["idle"])
        for key in totals:
            totals[key] += (row or {}).get(key) or 0
    whole = _split(totals, now_ns - since_ns)
    chart = {"kind": "bars", "x_type": "time", "unit": "pct", "x": x,
             "series": [{"name": "compute" if part == "compute" else "waiting on the ring" if part == "ring"
                         else "rest of step" if part == "rest" else "idle", "y": series[part]} for part in PARTS]}
    return {"since_ns": since_ns, "seconds": round((now_ns - since_ns) / 1e9, 3), "steps": totals["steps"],
            "timed_steps": totals["timed_steps"], **whole, "chart": chart}


def _load(loads: list[dict], instance: str) -> dict[str, Any] | None:
    """The node's latest load: its length and slowest stage."""
    mine = [row for row in loads if row["instance_id"] == instance]
    if not mine:
        return None
    latest = max(row["start_ns"] for row in mine)
    rows = [row for row in mine if row["start_ns"] == latest]
    stages = [(row["stage"], row["stage_end_ns"] - row["stage_start_ns"]) for row in rows if row["stage"]]
    slowest = max(stages, key=lambda s: s[1]) if stages else None
    return {"ms": round((rows[0]["end_ns"] - rows[0]["start_ns"]) / 1e6, 3),
            "slowest_stage": slowest[0].removeprefix("model.load.") if slowest else None,
            "slowest_stage_ms": round(slowest[1] / 1e6, 3) if slowest else None}


def _memory(beat: dict | None, session_tokens: float | None) -> dict[str, Any]:
    """A node's memory figures from its latest heartbeat, and what fits in its free memory."""
    if beat is None:
        return {"kv_bytes": None, "kv_bytes_per_token": None, "memory_bytes": None, "memory_free_bytes": None,
                "tokens_fit": None, "sessions_fit": None, "heartbeat_ns": None}
    per_token, free = beat["kv_bytes_per_token"], beat.get("memory_free_bytes")
    tokens = int(free // per_token) if free is not None and per_token else None
    sessions = int(free // (per_token * session_tokens)) if tokens is not None and session_tokens else None
    return {"kv_bytes": beat["cache_bytes"], "kv_bytes_per_token": per_token, "memory_bytes": beat["memory_bytes"],
            "memory_free_bytes": free, "tokens_fit": tokens, "sessions_fit": sessions, "heartbeat_ns": beat["t_ns"]}


def node_list(reader: TraceReader) -> dict[str, list[dict[str, Any]]]:
    """Per distributed instance (by its id), its nodes as each reported itself, in ring order: rank,
    ranks, the node's own instance id, host, placement and weight bytes (named query ``nodes``)."""
    found: dict[str, list[dict]] = {}
    for row in reader.frame("nodes").to_dicts():
        node = node_of(row["node_attributes"])
        if node is None:
            continue
        of, rank = node
        found.setdefault(of, []).append({
            "rank": rank, "ranks": _int(_attributes(row["node_attributes"]).get(c.NODE_RANKS)),
            "instance_id": row["instance_id"],
            "host": row["host_name"], "placement": _attributes(row["shard_attributes"]).get(c.NODE_PLACEMENT),
            "weight_bytes": row["weight_bytes"], "runner_stage": None, "stages": None})
    for nodes in found.values():
        nodes.sort(key=lambda n: n["rank"])
    return found


def clusters_of(reader: TraceReader, health: list[dict[str, Any]], now_ns: int) -> dict[str, dict[str, Any]]:
    """Per distributed instance (by its id): its nodes in ring order and what binds it (module docstring)."""
    from tokentrace.dashboards.cache_page import session_length  # cache_page imports the instances page

    found = node_list(reader)
    if not found:
        return {}
    status = {row["instance_id"]: row for row in health}
    beats = {b["instance_id"]: b for b in reader.frame("latest_heartbeats").to_dicts()}
    loads = reader.frame("loads_in", since_ns=None, until_ns=None).to_dicts()
    since = (now_ns - ACTIVITY_S * 10**9) // BUCKET_NS * BUCKET_NS
    result = {}
    for of, nodes in found.items():
        requests = reader.requests(since_ns=now_ns - SESSION_WINDOW_NS, instance_id=of, limit=SESSION_REQUESTS)
        session_tokens = session_length(requests)
        # From the cluster's latest start when that is more recent: not minutes of idle before it ran.
        starts = [row["start_ns"] for row in loads if row["instance_id"] in {n["instance_id"] for n in nodes}]
        start = max(since, max(starts) // BUCKET_NS * BUCKET_NS) if starts else since
        steps = reader.frame("node_activity", since_ns=start, until_ns=None, instance_id=of)
        for node in nodes:
            health_row = status.get(node["instance_id"], {})
            node.update(_memory(beats.get(node["instance_id"]), session_tokens))
            node["status"] = health_row.get("status", "unknown")
            node["last_seen_age_s"] = health_row.get("last_seen_age_s")
            node["load"] = _load(loads, node["instance_id"])
            node["activity"] = activity(steps.filter(pl.col("instance_id") == node["instance_id"]).to_dicts(),
                                        start, now_ns)
            node["activity"]["since_start"] = start > since
        fits = [n for n in nodes if n["tokens_fit"] is not None]
        binding = min(fits, key=lambda n: n["tokens_fit"]) if fits else None
        slow_load = [n for n in nodes if n["load"]]
        result[of] = {
            "instance_id": of, "ranks": max((n["ranks"] or 0 for n in nodes), default=0) or len(nodes),
            "nodes": nodes, "median_session_tokens": None if session_tokens is None else round(session_tokens, 1),
            "binding_rank": binding["rank"] if binding else None,  #: the node whose free memory fits least
            "slowest_load_rank": max(slow_load, key=lambda n: n["load"]["ms"])["rank"] if slow_load else None,
            "missing_ranks": sorted(set(range(max((n["ranks"] or 0 for n in nodes), default=0)))
                                    - {n["rank"] for n in nodes}),
        }
    return result


def from_exo(instance: dict[str, Any]) -> dict[str, Any]:
    """An Exo instance (the gateway's ``cluster.state``, engine_shim/gateway/adapters/exo.py) as the
    same node model: its nodes in ring order (Exo's device rank), what each holds and its free
    memory. What Exo's ``/state`` does not say (weights and KV per node, load stages, step time) is
    None: unknown, drawn as n/a; its runner stage and the four readiness stages come along."""
    nodes = []
    for i, node in enumerate(instance.get("nodes") or []):
        rank = node.get("rank")
        nodes.append({
            "rank": rank if rank is not None else i, "ranks": node.get("ranks"), "instance_id": node.get("node_id"),
            "host": node.get("name") or node.get("node_id"), "placement": node.get("placement") or _layers(node),
            "weight_bytes": None, "kv_bytes": None, "kv_bytes_per_token": None, "memory_bytes": None,
            "memory_free_bytes": node.get("memory_free_bytes"), "memory_total_bytes": node.get("memory_total_bytes"),
            "tokens_fit": None, "sessions_fit": None, "status": node.get("stage"), "load": None, "activity": None,
            "runner_stage": node.get("stage"), "stages": node.get("stages")})
    nodes.sort(key=lambda n: n["rank"])
    ranks = max((n["ranks"] or 0 for n in nodes), default=0) or len(nodes)
    return {"instance_id": instance.get("instance_id"), "ranks": ranks, "nodes": nodes,
            "median_session_tokens": None, "binding_rank": None, "slowest_load_rank": None,
            "missing_ranks": sorted(set(range(ranks)) - {n["rank"] for n in nodes})}


def _layers(node: dict[str, Any]) -> str | None:
    """A cluster.state stored before it carried the placement: its layer range (end exclusive)."""
    layers = node.get("layers") or [None, None]
    if layers[0] is None or layers[1] is None:
        return None
    return f"layers {layers[0]}-{layers[1] - 1} of {node.get('n_layers') or '?'}"
