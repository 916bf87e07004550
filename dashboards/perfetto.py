"""Chrome trace-event JSON (the format ui.perfetto.dev and chrome://tracing open) from the store.

Layout: one process per instance; in it one thread (track) per request with its phases as complete
("X") events in order, one track of engine steps, one of model-load stages, and one of cache
evictions as instant ("i") events. Phases on one track never overlap: each event starts no earlier
than the previous one ended (a phase that began before its predecessor's end, e.g. the cache
lookup inside prefill, is folded into the args of the phase that covers it, or clipped).

Times are microseconds (the format's unit) from ``otherData.t0_ns``, the earliest event, so that
doubles keep nanosecond precision. Format reference: "Trace Event Format" (Google, 2016).
"""

from __future__ import annotations

from typing import Any

import polars as pl

from tokentrace.analyzers.cache import request_window
from tokentrace.analyzers.report import with_categories
from tokentrace.collector.stores.store import TraceReader
from tokentrace.errors import NotFound

#: Phase spans drawn on a request's track, with their display names.
PHASE_NAMES = {"llm.load_wait": "load_wait", "llm.queue": "queue", "llm.prefill": "prefill",
               "llm.decode": "decode", "llm.cache.insert": "cache insert"}
STEPS_TID, LOADS_TID, EVICTIONS_TID, FIRST_REQUEST_TID = 1, 2, 3, 10
MAX_REQUESTS = 100_000


class _Events:
    """Accumulates events with times relative to ``t0_ns``, keeping each track free of overlaps."""

    def __init__(self, t0_ns: int):
        self.t0 = t0_ns
        self.events: list[dict[str, Any]] = []
        self._track_end: dict[tuple[int, int], int] = {}

    def us(self, ns: int) -> float:
        return round((ns - self.t0) / 1000, 3)

    def meta(self, pid: int, tid: int | None, name: str, value: Any) -> None:
        """A metadata event: process_name / thread_name take {"name"}, *_sort_index {"sort_index"}."""
        key = "sort_index" if name.endswith("sort_index") else "name"
        event = {"ph": "M", "name": name, "pid": pid, "args": {key: value}}
        if tid is not None:
            event["tid"] = tid
        self.events.append(event)

    def complete(self, pid: int, tid: int, name: str, start_ns: int, end_ns: int, cat: str, args: dict) -> None:
        """An X event, clipped to start where the track's previous event ended."""
        start_ns = max(start_ns, self._track_end.get((pid, tid), start_ns))
        end_ns = max(start_ns, end_ns)
        self._track_end[(pid, tid)] = end_ns
        self.events.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": self.us(start_ns),
                            "dur": round((end_ns - start_ns) / 1000, 3), "args": args})

    def instant(self, pid: int, tid: int, name: str, t_ns: int, cat: str, args: dict) -> None:
        self.events.append({"ph": "i", "s": "t", "name": name, "cat": cat, "pid": pid, "tid": tid,
                            "ts": self.us(t_ns), "args": args})


def _summary_phases(row: dict) -> list[tuple[str, int, int]]:
    """Phases from the request row's summary (engines that send no phase spans)."""
    t, out = row["start_ns"], []
    for name in ("load_wait", "queue", "prefill", "decode"):
        if row.get(f"{name}_ms") is None:
            break  # unknown, not 0: where the later phases start is unknown too
        length = int(row[f"{name}_ms"] * 1e6)
        if length > 0:
            out.append((name, t, min(row["end_ns"], t + length)))
        t += length
    return out


def _request_events(ev: _Events, pid: int, tid: int, row: dict, phases: list[dict], chunks: list[dict]) -> None:
    rid = row["request_id"]
    ev.meta(pid, tid, "thread_name", f"request {rid}")
    ev.meta(pid, tid, "thread_sort_index", tid)
    spans = [(PHASE_NAMES[p["name"]], p["start_ns"], p["end_ns"]) for p in phases if p["name"] in PHASE_NAMES]
    spans = sorted(spans, key=lambda s: s[1]) or _summary_phases(row)
    summary = {"request_id": rid, "session_id": row.get("session_id"), "category": row.get("category"),
               "outcome": row.get("outcome"),
               "prompt_tokens": row.get("prompt_tokens"), "cached_tokens": row.get("cached_tokens"),
               "completion_tokens": row.get("completion_tokens"), "ttft_ms": row.get("ttft_ms"),
               "tpot_ms": row.get("tpot_ms"), "e2e_ms": round((row["end_ns"] - row["start_ns"]) / 1e6, 3)}
    for k, (name, start, end) in enumerate(spans):
        args: dict[str, Any] = dict(summary) if k == 0 else {"request_id": rid}
        if name == "prefill":
            args["chunks"] = [{"offset": c["chunk_offset"], "tokens": c["tokens"], "batch_size": c["batch_size"],
                               "start_us": ev.us(c["start_ns"]),
                               "dur_us": round((c["end_ns"] - c["start_ns"]) / 1000, 3)} for c in chunks]
        ev.complete(pid, tid, name, start, end, "request", args)


def _instance_events(ev: _Events, pid: int, steps: list[dict], loads: list[dict], evictions: list[dict]) -> None:
    for name, tid in (("engine steps", STEPS_TID), ("model load", LOADS_TID), ("cache evictions", EVICTIONS_TID)):
        ev.meta(pid, tid, "thread_name", name)
        ev.meta(pid, tid, "thread_sort_index", tid)
    for s in steps:
        kind = "+".join(k for k, n in (("prefill", s["prefill_seqs"]), ("decode", s["decode_seqs"])) if n) or "idle"
        ev.complete(pid, STEPS_TID, kind, s["start_ns"], s["start_ns"] + (s["duration_ns"] or 0), "step", {
            "prefill_seqs": s["prefill_seqs"], "decode_seqs": s["decode_seqs"], "prefill_tokens": s["prefill_tokens"],
            "decode_tokens": s["decode_tokens"], "prefill_requests": s["prefill_request_ids"],
            "decode_requests": s["decode_request_ids"]})
    for load in loads:
        start, end, name = ((load["stage_start_ns"], load["stage_end_ns"], load["stage"]) if load["stage"]
                            else (load["start_ns"], load["end_ns"], "model.load"))
        ev.complete(pid, LOADS_TID, name, start, end, "load", {"load_id": load["load_id"], "lazy": load["lazy"]})
    for e in evictions:
        ev.instant(pid, EVICTIONS_TID, f"evict {e['reason']}", e["t_ns"], "cache", {
            "reason": e["reason"], "tokens": e["tokens"], "bytes": e["bytes"], "fingerprint": e["fingerprint"],
            "entry_request_id": e["entry_request_id"], "evicted_by_request_id": e["evicted_by_request_id"],
            "cache_entries_after": e["cache_entries"], "cache_bytes_after": e["cache_bytes"]})


def _group(frame: pl.DataFrame, key: str) -> dict[Any, list[dict]]:
    groups: dict[Any, list[dict]] = {}
    for row in frame.iter_rows(named=True):
        groups.setdefault(row[key], []).append(row)
    return groups


def _facts(reader: TraceReader, request_id: str | None, since_ns: int | None, until_ns: int | None):
    if request_id is not None:
        requests = reader.frame("request", request_id=request_id)
        if requests.height == 0:
            raise NotFound(f"no request with id {request_id!r} in the store")
        requests = with_categories(requests)
        row = requests.row(0, named=True)
        lo, hi = row["start_ns"], row["end_ns"]
        phases = reader.frame("phases", request_id=request_id, **request_window(row))
        chunks = reader.frame("prefill_chunks_of", request_id=request_id, **request_window(row))
        scope = pl.col("instance_id") == row["instance_id"]
        steps = reader.bulk("steps_in", since_ns=lo, until_ns=hi, instance_id=row["instance_id"])
        evictions = reader.frame("evictions_in", since_ns=lo, until_ns=hi).filter(scope)
        loads = reader.frame("loads_in", since_ns=lo, until_ns=hi).filter(scope)
    else:
        requests = with_categories(reader.requests(since_ns=since_ns, until_ns=until_ns, limit=MAX_REQUESTS))
        phases = reader.bulk("phases_in", since_ns=since_ns, until_ns=until_ns)
        chunks = reader.bulk("prefill_chunks_in", since_ns=since_ns, until_ns=until_ns)
        steps = reader.bulk("steps_in", since_ns=since_ns, until_ns=until_ns, instance_id=None)
        evictions = reader.frame("evictions_in", since_ns=since_ns, until_ns=until_ns)
        loads = reader.frame("loads_in", since_ns=since_ns, until_ns=until_ns)
    return requests, phases, chunks, steps, evictions, loads


def perfetto_trace(reader: TraceReader, request_id: str | None = None, since_ns: int | None = None,
                   until_ns: int | None = None) -> dict[str, Any]:
    """The trace-event JSON object of one request (with its instance's steps, loads and evictions
    during it) or of every request that started in [since, until)."""
    requests, phases, chunks, steps, evictions, loads = _facts(reader, request_id, since_ns, until_ns)
    starts = [f[c].min() for f, c in ((requests, "start_ns"), (steps, "start_ns"), (evictions, "t_ns"),
                                      (loads, "start_ns")) if f.height]
    ev = _Events(min(starts) if starts else 0)
    instances = sorted(set(requests["instance_id"].fill_null("").to_list()) | set(steps["instance_id"].to_list())
                       | set(evictions["instance_id"].to_list()) | set(loads["instance_id"].to_list()), key=str)
    pids = {instance: i + 1 for i, instance in enumerate(instances)}
    by_instance = {name: _group(frame, "instance_id") for name, frame in
                   (("steps", steps), ("evictions", evictions), ("loads", loads))}
    for instance, pid in pids.items():
        ev.meta(pid, None, "process_name", f"instance {instance or '(none)'}")
        ev.meta(pid, None, "process_sort_index", pid)
        _instance_events(ev, pid, *(by_instance[k].get(instance, []) for k in ("steps", "loads", "evictions")))
    phases_of, chunks_of = _group(phases, "request_id"), _group(chunks, "request_id")
    next_tid: dict[int, int] = {}
    for row in requests.sort("start_ns").iter_rows(named=True):
        pid = pids[row["instance_id"] or ""]
        tid = next_tid.get(pid, FIRST_REQUEST_TID)
        next_tid[pid] = tid + 1
        _request_events(ev, pid, tid, row, phases_of.get(row["request_id"], []), chunks_of.get(row["request_id"], []))
    return {"traceEvents": ev.events, "displayTimeUnit": "ms",
            "otherData": {"producer": "tokentrace", "t0_ns": ev.t0, "requests": requests.height,
                          "request_id": request_id, "since_ns": since_ns, "until_ns": until_ns}}
