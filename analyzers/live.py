"""What the store can say of a request it holds no row of yet: one a distributed engine reports open
while its ring does not move (issue 46, "a new answer for a request that is stalled ... while the
request is still open").

A request's row arrives when it ends. A distributed engine's rank 0 whose ring operation has lasted
half its ``--rank-timeout`` says so on its heartbeats (``tokentrace.stall.*``) with the ids of the
requests it holds open (``tokentrace.requests.open``), at once and on every heartbeat until the
ring moves or the deadline fails them (docs/cluster.md). ``still_open`` reads the latest heartbeat
of the instance that last named the request: while that heartbeat still reports the stall and
names it, the request is open and stalled, and every surface that looks the request up says so
(``StillOpen``: the CLI, the JSON API, the request page) instead of "no request". ``stall_of`` is
the one reading of such a heartbeat, also /metrics' (``tokentrace_requests_stalled``,
dashboards/stall_gauges.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from tokentrace import contract as c
from tokentrace.analyzers.evidence import fmt_ms
from tokentrace.collector.stores.store import TraceReader
from tokentrace.errors import NotFound, StillOpen

#: How far back a stall report may name the request.
OPEN_LOOKBACK_NS = 10 * 60 * 1_000_000_000


@dataclass(frozen=True)
class Stall:
    """What a distributed rank 0's heartbeat says of a ring that has not moved (``tokentrace.stall.*``)."""

    state: str  #: RankStopped, RankLost or RankUnresponsive (analyzers/slowness.py STALL_STATES)
    reason: str | None  #: the same in words: which rank, its process id and state
    ms: int | None  #: how long the ring operation in progress had lasted when the heartbeat was sent
    held: tuple[str, ...]  #: the ids of the requests it held open then (at most 256: the engine's cap)
    #: the ranks its diagnosis named (exited, stopped or silent); empty when it singled none out, and
    #: from an engine older than ``tokentrace.stall.ranks``
    ranks: tuple[int, ...] = ()


def stall_of(attributes: str | dict[str, Any] | None) -> Stall | None:
    """The stall a heartbeat's attributes (its JSON, or parsed) report; None while its ring moves
    (no ``tokentrace.stall.state``) or when they cannot be read."""
    if isinstance(attributes, str):
        if c.STALL_STATE not in attributes:
            return None  # most heartbeats: not parsed
        try:
            attributes = json.loads(attributes)
        except ValueError:
            return None
    if not isinstance(attributes, dict) or not isinstance(state := attributes.get(c.STALL_STATE), str):
        return None
    held = attributes.get(c.OPEN_REQUESTS)
    ms = attributes.get(c.STALL_MS)
    ranks = attributes.get(c.STALL_RANKS)
    return Stall(state, attributes.get(c.STALL_REASON),
                 int(ms) if isinstance(ms, (int, float)) and not isinstance(ms, bool) else None,
                 tuple(str(rid) for rid in held) if isinstance(held, list) else (),
                 tuple(rank for rank in ranks if isinstance(rank, int) and not isinstance(rank, bool))
                 if isinstance(ranks, list) else ())


def still_open(reader: TraceReader, request_id: str, now_ns: int | None = None) -> str | None:
    """The live answer for ``request_id`` when its engine reports it open in a stall, else None."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    rows = reader.rows("open_stall", request_id=request_id, since_ns=now_ns - OPEN_LOOKBACK_NS)
    if not rows:
        return None
    row = rows[0]
    stall = stall_of(row["attributes"])
    if stall is None or request_id not in stall.held:
        return None  # the ring moved again since, or the request is no longer held: its row is coming
    age_ms = max(0, now_ns - row["t_ns"]) / 1e6
    others = len(stall.held) - 1
    return (f"request {request_id!r} is still open on {row['instance_id']}: no row yet, its verdicts come when it "
            f"ends. Stalled ({stall.state}): no step of the instance's ring has completed for "
            f"{fmt_ms(stall.ms) if stall.ms is not None else 'a while'}, as its rank 0 reported "
            f"{fmt_ms(age_ms)} ago; {stall.reason or 'which rank, it cannot tell'}"
            + (f"; {others} other request{'s' if others != 1 else ''} held open with it" if others > 0 else "")
            + ". Past its --rank-timeout the engine fails them.")


def not_found(reader: TraceReader, request_id: str) -> NotFound:
    """The error for a request id the store holds no row of: StillOpen with the live answer when
    its engine reports it open in a stall, else NotFound."""
    live = still_open(reader, request_id)
    return StillOpen(live) if live else NotFound(f"no request with id {request_id!r} in the store")
