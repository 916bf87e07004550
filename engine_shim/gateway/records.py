"""What the gateway records on the request path: plain numbers and the raw bytes, nothing parsed.

The request path appends ``perf_counter_ns()`` readings and received chunks to an ``Exchange``;
everything else (splitting the stream into events, reading usage, fingerprints, spans) happens
after the response ended, off the request path (``observe.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokentrace.engine_shim.gateway.adapters.base import Route
from tokentrace.engine_shim.gateway.router import Decision


class Clock:
    """Maps ``perf_counter_ns()`` readings to Unix epoch nanoseconds (offset read once)."""

    def __init__(self) -> None:
        before = time.perf_counter_ns()
        wall = time.time_ns()
        after = time.perf_counter_ns()
        self.offset_ns = wall - (before + after) // 2

    def epoch(self, perf_ns: int) -> int:
        """Unix nanoseconds of a ``perf_counter_ns()`` reading."""
        return perf_ns + self.offset_ns


@dataclass
class Exchange:
    """One request through the gateway."""

    request_id: str  #: X-Request-Id (honoured or generated)
    session_id: str | None  #: X-Session-Id, else the OpenAI ``user`` field
    route: Route  #: the route served
    body: dict[str, Any]  #: the client's JSON body
    streamed: bool  #: the client asked for a stream
    arrival_ns: int  #: perf_counter_ns at arrival
    client: str = ""  #: client address (for the record, not exported)
    decision: Decision | None = None  #: the final routing decision
    policy: str = ""  #: routing policy in force
    attempts: int = 0  #: upstreams tried
    skipped: list[str] = field(default_factory=list)  #: "name:reason" of upstreams that failed it
    wait_ns: int = 0  #: waited at the gateway for a slot (all attempts)
    queue_depth: int = 0  #: requests already waiting for the chosen upstream when this one arrived
    queue_running: int = 0  #: requests in flight on the chosen upstream when this one arrived
    admitted_ns: int | None = None  #: perf time the slot was granted (last attempt)
    sent_ns: int | None = None  #: perf time the request went upstream (last attempt)
    headers_ns: int | None = None  #: perf time the upstream's status line arrived
    status: int | None = None  #: HTTP status sent to the client
    upstream_headers: httpx.Headers | None = None  #: the upstream's response headers
    chunks: list[tuple[int, bytes]] = field(default_factory=list)  #: (perf ns, bytes) as received
    end_ns: int | None = None  #: perf time the last byte went to the client
    client_disconnected: bool = False  #: the client went away before the end
    error_type: str | None = None  #: what failed, when something did
    injected_usage: bool = False  #: the gateway asked for stream usage the client did not
