"""A checker for Chrome trace-event JSON ("Trace Event Format", Google 2016; what ui.perfetto.dev
and chrome://tracing import), written from the format document and independent of the exporter.

``problems(trace)`` lists every violation found; an empty list means the trace is valid. Beyond the
format it checks the property tokentrace promises: complete ("X") events on one track (pid, tid)
never overlap.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict

#: Event phases of the format (duration, complete, instant, counter, async, flow, sample, object,
#: metadata, memory dump, mark, clock sync, context).
PHASES = set("BEXiIPCbnestfNODMVvRc(),")
METADATA = {"process_name": "name", "process_labels": "labels", "process_sort_index": "sort_index",
            "thread_name": "name", "thread_sort_index": "sort_index"}
#: Microseconds of slack for floating-point rounding at a shared phase boundary.
EPSILON_US = 1e-6


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _event_problems(i: int, e: dict) -> list[str]:
    where = f"event {i} ({e.get('name')!r}, ph {e.get('ph')!r})"
    found = []
    if not isinstance(e.get("name"), str):
        found.append(f"{where}: name must be a string")
    ph = e.get("ph")
    if ph not in PHASES:
        return [*found, f"{where}: unknown phase"]
    if not isinstance(e.get("pid"), int):
        found.append(f"{where}: pid must be an integer")
    if ph == "M":
        key = METADATA.get(e.get("name"))
        if key is None or key not in (e.get("args") or {}):
            found.append(f"{where}: metadata needs a known name and args.{key or 'name'}")
        if e.get("name", "").startswith("thread_") and not isinstance(e.get("tid"), int):
            found.append(f"{where}: thread metadata needs an integer tid")
        return found
    if not isinstance(e.get("tid"), int):
        found.append(f"{where}: tid must be an integer")
    if not _number(e.get("ts")) or e["ts"] < 0:
        found.append(f"{where}: ts must be a finite number of microseconds >= 0")
    if ph == "X" and (not _number(e.get("dur")) or e["dur"] < 0):
        found.append(f"{where}: a complete event needs dur >= 0")
    if ph in "iI" and e.get("s", "t") not in ("g", "p", "t"):
        found.append(f"{where}: instant scope must be g, p or t")
    if "args" in e and not isinstance(e["args"], dict):
        found.append(f"{where}: args must be an object")
    return found


def problems(trace) -> list[str]:
    """Every way ``trace`` breaks the format or lets complete events overlap on a track."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["the trace must be an object with a traceEvents array (JSON Object Format)"]
    try:
        json.dumps(trace, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return [f"not strict JSON: {exc}"]
    found: list[str] = []
    tracks: dict[tuple[int, int], list[tuple[float, float, str]]] = defaultdict(list)
    for i, event in enumerate(trace["traceEvents"]):
        if not isinstance(event, dict):
            found.append(f"event {i} is not an object")
            continue
        mistakes = _event_problems(i, event)
        found += mistakes
        if not mistakes and event["ph"] == "X":
            tracks[(event["pid"], event["tid"])].append((event["ts"], event["ts"] + event["dur"], event["name"]))
    for track, spans in tracks.items():
        spans.sort()
        for (_s0, e0, n0), (s1, _e1, n1) in itertools.pairwise(spans):
            if s1 < e0 - EPSILON_US:
                found.append(f"track {track}: {n1!r} at {s1} us starts before {n0!r} ends at {e0} us")
    return found
