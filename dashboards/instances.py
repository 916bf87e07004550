"""``/instances``: readiness of every instance, the four states of a cold start from the field
report (files present -> process started -> runner ready -> first real answer), its load stages,
its last heartbeat, and whether it went stale.

An instance is *stale* when nothing from it (span or heartbeat) arrived for ``STALE_AFTER_S``
seconds: six missed heartbeats at the engine's default interval of 5 s; *stopped* when it recorded
``instance.stopped`` since it started. Only an instance that is up has live figures (``now``: its
latest heartbeat's queue and running counts); a stopped or stale one shows when it was last heard
and when it stopped, and its last heartbeat stays in the JSON with ``live`` false (issue 44: a
stopped instance kept showing its last heartbeat's "running 3").

The cold start is process start -> runner ready (``cold_start_ms``). The first answer is not part
of it when the instance sat idle before its first request arrived: ``first_answer`` says when the
first request arrived, against process start and runner ready, and how long it then took (issue 44:
an engine idle for 39 s after a 576 ms start read "process start to first answer: 39.28 s").
"""

from __future__ import annotations

import json
import time
from typing import Any

import polars as pl
from fastapi import Request

from tokentrace import contract as c
from tokentrace.collector.stores.store import TraceReader
from tokentrace.dashboards.nodes import clusters_of, from_exo
from tokentrace.dashboards.web import page

STALE_AFTER_S = 30.0
#: Most requests read to find an instance's first one (those that started before its first answer).
FIRST_REQUESTS = 100_000
#: (key, label, where it comes from), in the field report's order.
READINESS = (
    ("files_present", "files present", "model.load.resolve ended"),
    ("started", "process started", "instance.started"),
    ("ready", "runner ready", "instance.ready"),
    ("first_response", "first answer", "instance.first_response"),
)
_STAGE_PREFIX = "model.load."


def _rows(frame: pl.DataFrame, instance: str) -> list[dict]:
    if frame.height == 0:
        return []
    return frame.filter(pl.col("instance_id") == instance).to_dicts()


def _first_at_or_after(events: list[dict], name: str, t_ns: int) -> int | None:
    times = [e["t_ns"] for e in events if e["event"] == name and e["t_ns"] >= t_ns]
    return min(times) if times else None


def _load(loads: list[dict], since_ns: int) -> dict[str, Any] | None:
    """The instance's latest load that began at or after ``since_ns`` (else its latest load), with stages."""
    if not loads:
        return None
    starts = sorted({row["start_ns"] for row in loads})
    after = [s for s in starts if s >= since_ns]
    chosen = after[0] if after else starts[-1]
    rows = [row for row in loads if row["start_ns"] == chosen]
    first = rows[0]
    total_ms = (first["end_ns"] - first["start_ns"]) / 1e6
    stages = [{"name": row["stage"].removeprefix(_STAGE_PREFIX), "span": row["stage"],
               "start_ns": row["stage_start_ns"], "end_ns": row["stage_end_ns"],
               "ms": round((row["stage_end_ns"] - row["stage_start_ns"]) / 1e6, 3),
               "share": round((row["stage_end_ns"] - row["stage_start_ns"]) / 1e6 / total_ms, 4) if total_ms else None}
              for row in rows if row["stage"]]
    resolve = [s["end_ns"] for s in stages if s["span"] == "model.load.resolve"]
    return {"load_id": first["load_id"], "lazy": first["lazy"], "model_path": first["model_path"],
            "start_ns": first["start_ns"], "end_ns": first["end_ns"], "ms": round(total_ms, 3),
            "stages": stages, "files_present_ns": resolve[0] if resolve else None}


def _readiness(events: list[dict], load: dict | None, started: int | None, epoch_ns: int) -> list[dict[str, Any]]:
    times = {
        "files_present": load["files_present_ns"] if load else None,
        "started": started,
        "ready": _first_at_or_after(events, "instance.ready", epoch_ns),
        "first_response": _first_at_or_after(events, "instance.first_response", epoch_ns),
    }
    return [{"state": key, "label": label, "source": source, "t_ns": times[key], "reached": times[key] is not None,
             "after_start_ms": round((times[key] - started) / 1e6, 3)
             if times[key] is not None and started is not None else None}
            for key, label, source in READINESS]


def _ms_between(t0: int | None, t1: int | None) -> float | None:
    return None if t0 is None or t1 is None else round((t1 - t0) / 1e6, 3)


def _first_answer(reader: TraceReader, instance: str, readiness: list[dict], started: int | None,
                  epoch: int) -> dict[str, Any] | None:
    """When the instance's first request arrived, against its start and readiness, and whether the
    time to its first answer was idle waiting rather than start-up (None before a first answer)."""
    ready, answered = readiness[2]["t_ns"], readiness[3]["t_ns"]
    if answered is None:
        return None
    arrivals = reader.requests(since_ns=epoch, until_ns=answered + 1, instance_id=instance, limit=FIRST_REQUESTS)
    arrived = int(arrivals["start_ns"].min()) if arrivals.height else None
    return {
        "t_ns": answered, "after_start_ms": _ms_between(started, answered),
        "first_request_ns": arrived,  #: None: no request row of the instance says when it arrived
        "first_request_after_start_ms": _ms_between(started, arrived),
        "first_request_after_ready_ms": _ms_between(ready, arrived),
        # Arrived after the runner was ready: it found the instance idle, not starting.
        "idle": None if arrived is None or ready is None else arrived >= ready,
        "answered_after_arrival_ms": _ms_between(arrived, answered),
    }


def instance_health(reader: TraceReader, now_ns: int) -> list[dict[str, Any]]:
    """Every instance seen: identity, readiness, load, last heartbeat, status (up, stale, stopped)."""
    seen = reader.frame("instances")
    events = reader.frame("lifecycle")
    loads = reader.frame("loads_in", since_ns=None, until_ns=None)
    beats = reader.frame("latest_heartbeats")
    ids = set(seen["instance_id"].to_list()) | set(events["instance_id"].drop_nulls().to_list())
    result = []
    for instance in sorted(ids):
        identity = (_rows(seen, instance) or [{}])[0]
        mine = _rows(events, instance)
        started = max((e["t_ns"] for e in mine if e["event"] == "instance.started"), default=None)
        epoch = started if started is not None else (identity.get("first_seen_ns") or 0)
        load = _load(_rows(loads, instance), epoch)
        beat = (_rows(beats, instance) or [None])[0]
        heard = [t for t in (identity.get("last_seen_ns"), beat["t_ns"] if beat else None) if t is not None]
        last_ns = max(heard) if heard else None
        age_s = None if last_ns is None else round(max(0, now_ns - last_ns) / 1e9, 1)
        stops = [e["t_ns"] for e in mine if e["event"] == "instance.stopped" and e["t_ns"] >= epoch]
        readiness = _readiness(mine, load, started, epoch)
        reached = [step["label"] for step in readiness if step["reached"]]
        status = "stopped" if stops else ("stale" if age_s is None or age_s > STALE_AFTER_S else "up")
        live = status == "up"
        result.append({
            "instance_id": instance, "host": identity.get("host_name"), "engine": identity.get("engine"),
            "engine_version": identity.get("engine_version"), "model": identity.get("model"),
            "status": status,
            "live": live,  #: up: its heartbeat's figures are current; else they are its last, not now
            "stopped_ns": max(stops) if stops else None,
            "last_seen_ns": last_ns,
            "stage": reached[-1] if reached else "unknown",
            "readiness": readiness,
            "cold_start_ms": readiness[2]["after_start_ms"],  #: process start -> runner ready
            "start_to_first_answer_ms": readiness[3]["after_start_ms"],
            "first_answer": _first_answer(reader, instance, readiness, started, epoch),
            "load": load,
            "last_seen_age_s": age_s,
            #: the latest heartbeat, live only while the instance is up
            "heartbeat": None if beat is None else {**beat, "age_s": round(max(0, now_ns - beat["t_ns"]) / 1e9, 1),
                                                    "live": live},
            #: live figures, only while up: the latest heartbeat's queue and running counts
            "now": {"queue_depth": beat["queue_depth"], "running": beat["running"]} if live and beat else None,
        })
    return result


def clusters(reader: TraceReader) -> list[dict[str, Any]]:
    """Per upstream that manages a cluster (Exo, behind the gateway): its instances as of the latest
    ``cluster.state`` (model, per node its layers, runner stage and the four readiness stages) and the
    contradictions its views showed, each with the time first seen."""
    found = []
    for row in reader.frame("cluster_states").to_dicts():
        attrs = json.loads(row["attributes"] or "{}")
        instances = json.loads(attrs.get(c.CLUSTER_INSTANCES) or "[]")
        for instance in instances:
            instance["cluster"] = from_exo(instance)  #: the same node model as a tokentrace cluster's
        found.append({"upstream": row["instance_id"], "t_ns": row["t_ns"], "instances": instances,
                      "findings": attrs.get(c.CLUSTER_FINDINGS) or []})
    return found


@page("/instances", "instances.html", "Instances")
def instances_page(request: Request, instance: str | None = None) -> dict[str, Any]:
    """Readiness per instance (with ``instance``, a slice's: that one alone, with its nodes). Readiness
    is now, not over a window; a slice's model, session or request prefix says nothing about
    instances. A distributed instance carries its nodes (``cluster``, dashboards/nodes.py); its ranks
    above 0 stay rows of their own (``node_of`` names the instance), drawn inside it on the page."""
    now = time.time_ns()
    reader = request.app.state.reader
    rows = instance_health(reader, now)
    distributed = clusters_of(reader, rows, now)
    nodes = {node["instance_id"]: of for of, cluster in distributed.items() for node in cluster["nodes"]}
    for row in rows:
        #: a distributed instance's nodes (rank 0 first); a rank above 0 names the instance it is part of
        row["cluster"] = distributed.get(row["instance_id"])
        row["node_of"] = nodes.get(row["instance_id"]) if row["instance_id"] not in distributed else None
    if instance is not None:
        rows = [row for row in rows if instance in (row["instance_id"], row["node_of"])]
    return {"now_ns": now, "stale_after_s": STALE_AFTER_S, "instances": rows, "instance": instance,
            "stale": [row["instance_id"] for row in rows if row["status"] == "stale"],
            "clusters": clusters(request.app.state.reader)}
