"""Cache miss causes of a window, for pages that refresh every few seconds.

The rule is the window report's (``tokentrace.analyzers.report.cause_candidates``): the latest
``sample`` requests that did not reuse their whole prompt, one cache verdict each. A verdict costs
several queries (~70 ms on 10,000 requests), and a live page asks again every 5 s for mostly the
same requests, so verdicts are remembered per request for ``TTL_S`` seconds: a finished request's
cause depends only on what happened before its lookup, and the TTL bounds how long a late-arriving
span (a spool file ingested later) can leave a stale cause on the page.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import polars as pl

from tokentrace.analyzers.cache import NO_CAUSE, CacheVerdict, analyze_cache
from tokentrace.analyzers.report import cause_candidates
from tokentrace.collector.stores.store import TraceReader

TTL_S = 120.0
MAX_REMEMBERED = 10_000


class CauseMemo:
    """request id -> (when computed, cache verdict), least recently used first; safe from many threads."""

    def __init__(self, ttl_s: float = TTL_S, size: int = MAX_REMEMBERED):
        self.ttl_s, self.size = ttl_s, size
        self._items: OrderedDict[tuple[int, str], tuple[float, CacheVerdict]] = OrderedDict()
        self._lock = threading.Lock()

    def cause(self, reader: TraceReader, request_id: str) -> str:
        """The request's cache cause (NO_CAUSE when everything reusable was reused)."""
        return self.verdict(reader, request_id).cause or NO_CAUSE

    def verdict(self, reader: TraceReader, request_id: str) -> CacheVerdict:
        """The request's cache verdict, remembered for ``ttl_s`` (the advice panel reads the same)."""
        key, now = (id(reader), request_id), time.monotonic()
        with self._lock:
            hit = self._items.get(key)
            if hit and now - hit[0] < self.ttl_s:
                self._items.move_to_end(key)
                return hit[1]
        verdict = analyze_cache(reader, request_id)
        with self._lock:
            self._items[key] = (now, verdict)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return verdict


_MEMO = CauseMemo()
#: The cache verdicts the live pages share (the overview's causes, the advice).
remembered_verdict = _MEMO.verdict


def window_causes(reader: TraceReader, frame: pl.DataFrame, sample: int) -> tuple[dict[str, int], int]:
    """({cause: requests}, requests sampled) over a requests frame, by the window report's rule."""
    if frame.height == 0:
        return {}, 0
    chosen = cause_candidates(frame, sample)
    causes: dict[str, int] = {}
    for request_id in chosen["request_id"].to_list():
        cause = _MEMO.cause(reader, request_id)
        causes[cause] = causes.get(cause, 0) + 1
    return dict(sorted(causes.items())), chosen.height
