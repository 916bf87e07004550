"""Admission by bytes (issue 11 item 3): what the receiver holds in memory has one bound.

A request is admitted only if its cost fits the budget (``--max-pending-bytes``); it keeps its cost
from before its body is read until its batch is committed, so bodies being read, payloads being
parsed and batches waiting for the writer are all inside the one bound. Its cost is
``EXPANSION`` times its size: the body, plus the rows parsed from it, which measured 3.1 (small
generic spans) to 4.5 (engine spans) times the protobuf size in Python objects. A gzip body is
charged again by its decompressed size once that is known.

A committed request keeps part of its cost until its rows are in the store's tables: the DuckDB
store acknowledges a batch once it is in its journal and appends it to the tables behind that
(collector/journal.py), holding its columns in memory meanwhile. At the acknowledgement the hold
shrinks to the size of those columns and the store releases it once they are appended, or spilled
to disk while a merge is held up (``Hold.keep``; collector/journal.py), so batches waiting to be
appended in memory count against the same bound.

A refused request gets 503 + Retry-After before its body is read (Content-Length known) or as soon
as the bytes received pass the budget (chunked). The first request is always admitted, so a budget
smaller than one body still lets requests through one at a time.
"""

from __future__ import annotations

import threading

#: Memory a request holds per byte of body: the body and the rows parsed from it (measured above).
EXPANSION = 6


class Budget:
    """Bytes held by admitted requests, against a limit; safe from any thread."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()

    def take(self, cost: int) -> bool:
        """Admit ``cost`` bytes if they fit (or nothing else is held); False means refuse."""
        with self._lock:
            if self.used and self.used + cost > self.limit:
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
        """Hold ``cost`` more bytes if the budget admits them."""
        if not self.budget.take(cost):
            return False
        with self._lock:
            self.bytes += cost
        return True

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
