"""Upstream engines as the gateway sees them: reachable or down, how many requests it has in flight,
and a per-upstream concurrency limit whose overflow waits at the gateway (measured as queueing).

Everything here runs on the gateway's event loop; no locks are needed.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field

from tokentrace.engine_shim.gateway.adapters.base import Adapter


@dataclass
class Upstream:
    """One upstream engine."""

    name: str  #: the operator's name: the instance id of its rows
    base_url: str  #: e.g. http://10.0.0.11:8080
    limit: int  #: requests in flight before new ones wait at the gateway
    adapter: Adapter | None = None  #: set once detection succeeded
    down: bool = False  #: marked down: the router skips it until a poll finds it healthy
    down_reason: str = ""  #: why it was marked down, for the record and /health
    failures: int = 0  #: consecutive failures
    inflight: int = 0  #: requests holding a slot
    served: int = 0  #: requests forwarded so far
    _waiters: collections.deque = field(default_factory=collections.deque)

    @property
    def waiting(self) -> int:
        """Requests waiting at the gateway for a slot on this upstream."""
        return len(self._waiters)

    @property
    def load(self) -> int:
        """In flight plus waiting: what least_loaded compares."""
        return self.inflight + len(self._waiters)

    @property
    def saturated(self) -> bool:
        """Every slot is taken."""
        return self.inflight >= self.limit

    @property
    def usable(self) -> bool:
        """Detected and not marked down."""
        return self.adapter is not None and not self.down

    async def acquire(self) -> int:
        """Take a slot, waiting in arrival order when all are taken; returns the nanoseconds waited."""
        start = time.perf_counter_ns()
        if self.inflight < self.limit and not self._waiters:
            self.inflight += 1
            return 0
        future = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            await future  # release() hands its slot over: inflight is already counted for us
        except asyncio.CancelledError:
            if future in self._waiters:
                self._waiters.remove(future)
            elif future.done() and not future.cancelled():
                self.release()  # the slot arrived as we were cancelled: pass it on
            raise
        return time.perf_counter_ns() - start

    def release(self) -> None:
        """Give a slot back, straight to the longest waiter if any."""
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                future.set_result(None)
                return
        self.inflight -= 1

    def fail(self, reason: str, down_after: int) -> bool:
        """Count a failure; True when this one marks the upstream down (it was up)."""
        self.failures += 1
        if self.failures >= down_after and not self.down:
            self.down, self.down_reason = True, reason
            return True
        return False

    def succeed(self) -> bool:
        """Reset the failure count; True when the upstream was down and is up again."""
        self.failures = 0
        if self.down:
            self.down, self.down_reason = False, ""
            return True
        return False
