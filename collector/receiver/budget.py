"""Admission by bytes (issue 11 item 3): what the receiver holds in memory has one bound.

A request is admitted only if its cost fits the budget (``--max-pending-bytes``); it keeps its cost
from before its body is read until its batch is committed, so bodies being read, payloads being
parsed and batches waiting for the writer are all inside the one bound. Its cost is
``EXPANSION`` times its size: the body, plus the rows parsed from it, which measured 3.1 (small
generic spans) to 4.5 (engine spans) times the protobuf size in Python objects. A gzip body is
charged again by its decompressed size once that is known.

A committed request keeps part of its cost until its rows are in the store's tables: the DuckDB
store acknowledges a batch once it is in its journal and appends it to the tables behind that
(collector/stores/journal.py), holding its columns in memory meanwhile. At the acknowledgement the hold
shrinks to the size of those columns and the store releases it once they are appended, or spilled
to disk while a merge is held up (``Hold.keep``; collector/stores/journal.py), so batches waiting to be
appended in memory count against the same bound.

A refused request gets 503 + Retry-After before its body is read (Content-Length known) or as soon
as the bytes received pass the budget (chunked). The first request is always admitted, so a budget
smaller than one body still lets requests through one at a time, whether its size was declared or
its chunks are charged as they arrive (before issue 45's benchmark of attacks, a chunked body larger
than a sixth of the budget was refused with 503 at every retry, even by an idle collector).

A request holds its cost while its body arrives, so a body must keep arriving (``BodyDeadline``,
issue 45): three connections that each declared a large Content-Length and sent one byte held the
whole budget for as long as they stayed open, and every other sender got 503. The deadline bounds
how long one connection holds its share, not how long an attacker does: connections that reconnect
as soon as they are cut off took the budget back within milliseconds, before any sender waiting out
its Retry-After came back (bench/attacks.py: an honest sender got none of 10 tries through). So
under contention a body that arrives slower than the minimum rate gives up its reservation to the
request that finds the budget full (``Arrivals.make_room``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

#: Memory a request holds per byte of body: the body and the rows parsed from it (measured above).
EXPANSION = 6


class Budget:
    """Bytes held by admitted requests, against a limit; safe from any thread."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()

    def take(self, cost: int, own: int = 0) -> bool:
        """Admit ``cost`` bytes if they fit, or if nothing is held but the ``own`` bytes of the
        request asking (a request alone is admitted whatever its size); False means refuse."""
        with self._lock:
            if self.used > own and self.used + cost > self.limit:
                return False
            self.used += cost
            self.peak = max(self.peak, self.used)
            return True

    def add(self, cost: int) -> None:
        """Hold ``cost`` more bytes for a request already admitted (its decompressed size)."""
        with self._lock:
            self.used += cost
            self.peak = max(self.peak, self.used)

    def give(self, cost: int) -> None:
        """Release what a request held."""
        with self._lock:
            self.used -= cost

    def snapshot(self) -> dict:
        """For /healthz."""
        with self._lock:
            return {"limit_bytes": self.limit, "used_bytes": self.used, "peak_bytes": self.peak}


class Hold:
    """What one request holds of a ``Budget``; ``release`` gives it all back. Safe from any thread:
    the store's merge thread may release a hold while the request's handler shrinks it."""

    def __init__(self, budget: Budget):
        self.budget = budget
        self.bytes = 0
        self._lock = threading.Lock()

    def take(self, cost: int) -> bool:
        """Hold ``cost`` more bytes if the budget admits them (always, while this request is alone:
        a chunked body, charged as it arrives, is admitted whole as one declared by Content-Length)."""
        with self._lock:
            own = self.bytes
        if not self.budget.take(cost, own):
            return False
        with self._lock:
            self.bytes += cost
        return True

    def add(self, cost: int) -> None:
        """Hold ``cost`` more bytes whatever the budget says (memory already in use)."""
        self.budget.add(cost)
        with self._lock:
            self.bytes += cost

    def give(self, cost: int) -> None:
        """Give back part of what is held."""
        with self._lock:
            cost = min(cost, self.bytes)
            self.bytes -= cost
        self.budget.give(cost)

    def keep(self, cost: int) -> None:
        """Give back all but ``cost`` bytes (what a store still holds of the request)."""
        with self._lock:
            extra = max(0, self.bytes - cost)
            self.bytes -= extra
        self.budget.give(extra)

    def release(self) -> None:
        """Give back everything."""
        with self._lock:
            cost, self.bytes = self.bytes, 0
        self.budget.give(cost)


class Arrival:
    """One request whose body is arriving: when it began, the bytes received, what it holds."""

    __slots__ = ("began", "complete", "evicted", "hold", "received")

    def __init__(self, began: float):
        self.began = began
        self.received = 0
        self.complete = False
        self.hold: Hold | None = None  #: set by the receiver once it reserves for the body
        self.evicted = False  #: it gave its reservation up to a request waiting (``Arrivals.make_room``)


class Arrivals:
    """The requests whose bodies are arriving, and whether each keeps up with ``min_rate``. Used
    from the event loop only (BodyDeadline registers, the receiver asks for room)."""

    #: Seconds a body has before it can lose its reservation for arriving too slowly.
    GRACE_S = 1.0

    def __init__(self, min_rate: int):
        self.min_rate = min_rate
        self._open: set[Arrival] = set()
        self.evicted = 0  #: reservations given up so far

    def begin(self) -> Arrival:
        arrival = Arrival(time.monotonic())
        self._open.add(arrival)
        return arrival

    def end(self, arrival: Arrival) -> None:
        self._open.discard(arrival)

    def make_room(self, cost: int, hold: Hold) -> bool:
        """Take ``cost`` for ``hold`` once the budget is found full, after taking the reservations
        of bodies that arrive slower than ``min_rate`` (received / min_rate behind the seconds since
        they began, less ``GRACE_S``), the slowest first, until it fits; False if it still does not.
        An evicted body keeps holding what it has received (those bytes are in memory); the rest of
        its reservation is given back, and its connection is cut off with 408 at its next read."""
        now = time.monotonic()
        behind = sorted((arrival for arrival in self._open
                         if not arrival.complete and not arrival.evicted and arrival.hold is not None
                         and arrival.hold is not hold and arrival.hold.bytes > EXPANSION * arrival.received
                         and arrival.received / self.min_rate < now - arrival.began - self.GRACE_S),
                        key=lambda arrival: arrival.received / self.min_rate - (now - arrival.began))
        for arrival in behind:
            arrival.evicted = True
            self.evicted += 1
            arrival.hold.keep(EXPANSION * arrival.received)
            if hold.take(cost):
                return True
        return False


#: google.rpc.Code DEADLINE_EXCEEDED, the code of a 408's body.
_DEADLINE_EXCEEDED = 4


class BodyDeadline:
    """ASGI middleware: a request's body must arrive within ``timeout`` seconds plus one second for
    every ``min_rate`` bytes received so far (Apache's mod_reqtimeout ``body=T,MinRate=R``), or the
    request is cut off: the app's next read of the body sees the client gone (starlette's
    ``ClientDisconnect``), so the receiver gives back what it held of the budget at once, and the
    sender gets 408 with ``Connection: close``.

    Why 408 and a closed connection: the sender learns why (a slow link can send smaller batches or
    raise the settings), and the connection, whose rest of a body would never be read, is not kept
    for a next request. A body that arrives in time is not touched; a request without a body (GET)
    is not timed.
    """

    def __init__(self, app, timeout: float, min_rate: int, count=None, arrivals: Arrivals | None = None):
        self.app = app
        self.timeout = timeout  #: seconds a body may take beyond what ``min_rate`` allows
        self.min_rate = min_rate  #: bytes a second of a body that earn it one more second
        self.count = count  #: called once for each request cut off (``rejected.body_timeout``)
        #: The bodies arriving, shared with the receiver (its ``make_room``); each request's is
        #: ``scope["state"]["arrival"]``.
        self.arrivals = arrivals if arrivals is not None else Arrivals(min_rate)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        arrival, expired = self.arrivals.begin(), False
        scope.setdefault("state", {})["arrival"] = arrival

        async def timed_receive():
            nonlocal expired
            if arrival.complete or expired:  # past the body: the app waits for a disconnect, untimed
                return await receive()
            left = arrival.began + self.timeout + arrival.received / self.min_rate - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.001))
            except TimeoutError:
                expired = True
                return {"type": "http.disconnect"}
            if arrival.evicted:  # its reservation went to a request waiting: cut off as if late
                expired = True
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                arrival.received += len(message.get("body", b""))
                arrival.complete = not message.get("more_body", False)
            return message

        async def closing_send(message):
            if expired and message["type"] == "http.response.start":  # the rest of the body is never read
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        from starlette.requests import ClientDisconnect

        try:
            await self.app(scope, timed_receive, closing_send)
        except ClientDisconnect:
            if not expired:
                raise
            await self._answer(arrival, send)
        finally:
            self.arrivals.end(arrival)
        if expired and self.count is not None:
            self.count()

    async def _answer(self, arrival: Arrival, send) -> None:
        """408: the body did not arrive in time, or arrived slower than the minimum rate while others
        waited for its reservation."""
        if arrival.evicted:
            message = (f"the request body arrived slower than {self.min_rate} bytes a second ({arrival.received} "
                       f"bytes in {time.monotonic() - arrival.began:.1f} s) while the collector's byte budget was "
                       f"full, and its reservation went to a request waiting (--body-min-rate)")
        else:
            message = (f"the request body did not arrive in time: {arrival.received} bytes in {self.timeout:g} s "
                       f"+ 1 s per {self.min_rate} bytes received (--body-timeout, --body-min-rate)")
        body = json.dumps({"code": _DEADLINE_EXCEEDED, "message": message}).encode()
        await send({"type": "http.response.start", "status": 408,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
