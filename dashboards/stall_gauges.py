"""/metrics' stall series (issue 46): how many requests each distributed instance holds open while
its ring stands still, and for how long it has stood still, from its rank 0's newest heartbeat.

A distributed engine's rank 0 whose ring operation has lasted half its ``--rank-timeout`` says so on
every heartbeat (``tokentrace.stall.*``, with the ids of the requests it holds open) until the ring
moves or the deadline fails them (docs/cluster.md). The heartbeat is read by ``analyzers.live.stall_of``,
the reading the live answer of a request page, the API and the CLI use. Per instance:

    tokentrace_requests_stalled{state}  = requests its newest heartbeat holds open in a stall of that
                                          state; 0 for the other states and while the ring moves
    tokentrace_stall_seconds            = how long the ring had not moved at that heartbeat; 0 while it moves

Each is served for the rank 0 of a distributed instance (a resource with ``tokentrace.node.rank`` 0)
whose newest heartbeat declares its stall watch on (``tokentrace.stall.rank_timeout_ms`` above 0),
and for any instance while it reports a stall, as long as that heartbeat is at most ``STALE_AFTER_S``
old, the window in which the instances page counts an instance up (dashboards/instances.py). Past it
the instance's state now is unknown: the series are absent, not 0 (Prometheus marks them stale).
So are they for a rank 0 whose watch is off (``--rank-timeout 0``: it never reports a stall, so its
"no stall" says nothing of its ring) and for one that does not declare its watch (an engine older
than the attribute: it may run with ``--rank-timeout 0``); a stall report, which only a running watch
sends, is served from either.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from tokentrace import contract as c
from tokentrace.analyzers.live import Stall, stall_of
from tokentrace.analyzers.slowness import STALL_STATES
from tokentrace.dashboards.instances import STALE_AFTER_S

#: The columns of a heartbeat span kept for the fold (the spans table's names).
BEAT_COLUMNS = ("instance_id", "end_ns", "attributes")


def heartbeat_spans(tables: dict[str, pa.Table]) -> pa.Table | None:
    """A committed batch's heartbeat spans, three columns of them (``BEAT_COLUMNS``); None when it
    holds none. Only a batch with heartbeat rows is searched (the writer's thread calls this)."""
    spans = tables.get("spans")
    if spans is None or "heartbeats" not in tables:
        return None
    # a filter copies what it keeps: the batch's buffers are not held past the fold
    beats = spans.filter(pc.equal(spans.column("name"), c.SPAN_HEARTBEAT)).select(list(BEAT_COLUMNS))
    return beats if beats.num_rows else None


def _parsed(attributes: str | dict[str, Any] | None) -> dict[str, Any] | str | None:
    """A heartbeat's attributes, parsed only where they hold a stall report or a stall watch's
    declaration (most heartbeats, those of one-process engines, hold neither)."""
    if not isinstance(attributes, str) or (c.STALL_STATE not in attributes
                                           and c.STALL_RANK_TIMEOUT_MS not in attributes):
        return attributes
    try:
        return json.loads(attributes)
    except ValueError:
        return None


def watched(attributes: str | dict[str, Any] | None) -> bool | None:
    """Whether a heartbeat declares its instance's stall watch on (``tokentrace.stall.rank_timeout_ms``
    above 0); False: declared off; None: not declared (an older engine, a one-process one) or unreadable."""
    if not isinstance(attributes, dict):
        return None
    ms = attributes.get(c.STALL_RANK_TIMEOUT_MS)
    return ms > 0 if isinstance(ms, (int, float)) and not isinstance(ms, bool) else None


class StallGauges:
    """The newest heartbeat's stall of every instance (fold), printed as gauges (``samples``)."""

    def __init__(self) -> None:
        #: instance -> (its newest heartbeat's time, the stall it reports or None, whether it declares
        #: its stall watch on: ``watched``)
        self.latest: dict[str, tuple[int, Stall | None, bool | None]] = {}

    def fold(self, beats: pa.Table) -> None:
        """Keep each instance's newest heartbeat of ``beats`` (``BEAT_COLUMNS``) newer than the one held."""
        newest: dict[str, tuple[int, Any]] = {}
        for instance, t_ns, attributes in zip(*(beats.column(name).to_pylist() for name in BEAT_COLUMNS),
                                              strict=True):
            if (instance and t_ns is not None and t_ns >= self.latest.get(instance, (-1,))[0]
                    and t_ns >= newest.get(instance, (-1,))[0]):
                newest[instance] = (t_ns, attributes)
        for instance, (t_ns, attributes) in newest.items():  # one parse an instance a batch, at most
            attributes = _parsed(attributes)
            self.latest[instance] = (t_ns, stall_of(attributes), watched(attributes))

    def samples(self, labels: Callable[..., tuple], rank0: Callable[[str], bool],
                now_ns: int | None = None) -> list[tuple[str, tuple, float]]:
        """(series, labels, value) of each instance with a fresh heartbeat that reports a stall, or is
        the rank 0 of a distributed instance and declares its stall watch on (module docstring);
        ``labels(instance, **extra)`` the series' labels, ``rank0(instance)`` whether it is a
        distributed instance's rank 0."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        out = []
        for instance, (t_ns, stall, watch) in sorted(self.latest.items()):
            if now_ns - t_ns > STALE_AFTER_S * 1e9 or (stall is None and not (watch and rank0(instance))):
                continue  # stale, or a "no stall" from no watch (off, or not declared): unknown, not 0
            held = dict.fromkeys(STALL_STATES, 0)
            if stall is not None:
                held[stall.state] = len(stall.held)
            out += [("tokentrace_requests_stalled", labels(instance, state=state), n) for state, n in held.items()]
            if stall is None or stall.ms is not None:  # a stall of unknown length: no figure, not 0
                out.append(("tokentrace_stall_seconds", labels(instance), stall.ms / 1000 if stall else 0))
        return out
