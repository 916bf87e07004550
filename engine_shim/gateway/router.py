"""Routing policies: which upstream serves a request, with the candidates, their scores and the reason
recorded for every decision (the ``gateway.route`` span).

- ``round_robin``: the next usable upstream in turn.
- ``least_loaded``: the fewest requests in flight plus waiting at the gateway.
- ``session``: the upstream that served the session before (sticky); a new session, or one whose
  upstream is down or saturated, goes to the least loaded and sticks there.
- ``prefix``: the upstream that most recently served the longest matching prefix of this prompt
  (byte-level block hashes of the rendered messages, ``prompt.routing_blocks``), among upstreams
  whose load is within ``--prefix-load-bound`` times the least loaded (+1); ties to the least loaded.

Scores: higher wins. round_robin: minus the position in the rotation; least_loaded: minus the load;
session: 1 for the sticky upstream, else minus the load; prefix: matched blocks.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from tokentrace import contract as c
from tokentrace.engine_shim.gateway.upstreams import Upstream

#: Sessions remembered by the session policy, and blocks remembered per upstream by the prefix
#: policy; the oldest are forgotten first.
MAX_SESSIONS = 100_000
MAX_BLOCKS = 200_000


@dataclass(frozen=True)
class Decision:
    """One routing decision."""

    upstream: Upstream  #: the choice
    candidates: tuple[str, ...]  #: upstreams considered, best first
    scores: tuple[float, ...]  #: their scores, same order
    reason: str  #: why, in words


class Router:
    """Chooses an upstream per request under one policy."""

    def __init__(self, policy: str, upstreams: list[Upstream], load_bound: float = 1.5):
        if policy not in (c.POLICY_ROUND_ROBIN, c.POLICY_LEAST_LOADED, c.POLICY_SESSION, c.POLICY_PREFIX):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy = policy
        self.upstreams = upstreams
        self.load_bound = load_bound
        self._turn = 0
        self._sessions: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._blocks: dict[str, collections.OrderedDict[int, None]] = {u.name: collections.OrderedDict()
                                                                       for u in upstreams}

    def choose(self, session: str | None, blocks: list[int] | None, exclude: set[str]) -> Decision | None:
        """The decision for a request, among usable upstreams not in ``exclude``; None if none is."""
        usable = [u for u in self.upstreams if u.usable and u.name not in exclude]
        if not usable:
            return None
        if self.policy == c.POLICY_ROUND_ROBIN:
            return self._round_robin(usable)
        if self.policy == c.POLICY_LEAST_LOADED:
            return self._least_loaded(usable, "fewest requests in flight")
        if self.policy == c.POLICY_SESSION:
            return self._session(usable, session)
        return self._prefix(usable, blocks or [])

    def served(self, decision: Decision, session: str | None, blocks: list[int] | None) -> None:
        """Remember what the chosen upstream now holds (session stickiness, prefix blocks)."""
        name = decision.upstream.name
        if session is not None and self.policy == c.POLICY_SESSION:
            self._sessions[session] = name
            self._sessions.move_to_end(session)
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        if blocks and self.policy == c.POLICY_PREFIX:
            held = self._blocks.setdefault(name, collections.OrderedDict())
            for block in blocks:
                held[block] = None
                held.move_to_end(block)
            while len(held) > MAX_BLOCKS:
                held.popitem(last=False)

    def _round_robin(self, usable: list[Upstream]) -> Decision:
        order = sorted(usable, key=lambda u: (self.upstreams.index(u) - self._turn) % len(self.upstreams))
        self._turn = (self.upstreams.index(order[0]) + 1) % len(self.upstreams)
        return Decision(order[0], tuple(u.name for u in order), tuple(-float(i) for i in range(len(order))),
                        "next in turn")

    def _least_loaded(self, usable: list[Upstream], reason: str) -> Decision:
        order = sorted(usable, key=lambda u: (u.load, u.served, self.upstreams.index(u)))
        return Decision(order[0], tuple(u.name for u in order), tuple(-float(u.load) for u in order),
                        f"{reason} ({order[0].load})")

    def _session(self, usable: list[Upstream], session: str | None) -> Decision:
        if session is None:
            return self._least_loaded(usable, "no session id: least loaded")
        sticky = self._sessions.get(session)
        here = next((u for u in usable if u.name == sticky), None)
        if here is not None and not here.saturated:
            others = [u for u in usable if u is not here]
            return Decision(here, (here.name, *(u.name for u in others)),
                            (1.0, *(-float(u.load) for u in others)), f"session {session} is served here")
        if sticky is None:
            return self._least_loaded(usable, f"new session {session}: least loaded")
        state = "saturated" if here is not None else "down"
        free = [u for u in usable if not u.saturated] or usable
        return self._least_loaded(free, f"session {session} failed over from {sticky} ({state}): least loaded")

    def _prefix(self, usable: list[Upstream], blocks: list[int]) -> Decision:
        least = min(u.load for u in usable)
        bound = self.load_bound * (least + 1)
        within = [u for u in usable if u.load <= bound]
        depth = {u.name: self._depth(u.name, blocks) for u in within}
        order = sorted(within, key=lambda u: (-depth[u.name], u.load, u.served, self.upstreams.index(u)))
        best = order[0]
        reason = (f"holds the longest prefix ({depth[best.name]} of {len(blocks)} blocks)" if depth[best.name]
                  else "no upstream holds a prefix: least loaded")
        skipped = len(usable) - len(within)
        if skipped:
            reason += f"; {skipped} over the load bound"
        return Decision(best, tuple(u.name for u in order), tuple(float(depth[u.name]) for u in order), reason)

    def _depth(self, name: str, blocks: list[int]) -> int:
        held = self._blocks.get(name) or {}
        depth = 0
        for block in blocks:
            if block not in held:
                break
            depth += 1
        return depth
