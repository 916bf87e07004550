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
whole budget for as long as they stayed open, and every other sender got 503.
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

    def __init__(self, app, timeout: float, min_rate: int, count=None):
        self.app = app
        self.timeout = timeout  #: seconds a body may take beyond what ``min_rate`` allows
        self.min_rate = min_rate  #: bytes a second of a body that earn it one more second
        self.count = count  #: called once for each request cut off (``rejected.body_timeout``)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        began, received, expired, complete = time.monotonic(), 0, False, False

        async def timed_receive():
            nonlocal received, expired, complete
            if complete or expired:  # past the body: the app waits for a disconnect, untimed
                return await receive()
            left = began + self.timeout + received / self.min_rate - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.001))
            except TimeoutError:
                expired = True
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
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
            await self._answer(received, send)
        if expired and self.count is not None:
            self.count()

    async def _answer(self, received: int, send) -> None:
        """408: the body did not arrive in time."""
        message = (f"the request body did not arrive in time: {received} bytes in "
                   f"{self.timeout:g} s + 1 s per {self.min_rate} bytes received (--body-timeout, --body-min-rate)")
        body = json.dumps({"code": _DEADLINE_EXCEEDED, "message": message}).encode()
        await send({"type": "http.response.start", "status": 408,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
