"""One request, several observers: the rule every surface follows (docs/analyzers.md).

A request that went through the gateway to an engine that reports itself (a tokentrace engine, vLLM
with the plugin) has two ``requests`` rows with one request id: the engine's (``observer`` engine,
plugin or native: the view inside) and the gateway's (``observer`` gateway: the view outside, from
the client's arrival to its last byte). It is one request. The store's named queries merge the two
rows into one (``collector/stores/sql/<backend>/fragments/request_rows.sql``); /metrics, which counts rows
as the writer commits them, before either may have a partner, counts a request id once per pair of
views with ``FirstSighting``.
"""

from __future__ import annotations

import polars as pl

from tokentrace import contract as c

#: Request ids remembered per side (inside, outside) for the pairing: a partner arrives within
#: seconds (each observer exports within a second or so of the end); 100,000 is minutes of a busy
#: collector's traffic.
REMEMBER = 100_000


class FirstSighting:
    """Keeps, of the rows of each request id, the first a collector received, whichever observer
    sent it; within one frame, the inside view. Only a pair of an outside (gateway) and an inside row
    is one request: rows of one observer with one id (a client reusing an id) all count, as before."""

    def __init__(self, remember: int = REMEMBER):
        self.remember = remember
        self._seen = {True: pl.Series("request_id", [], dtype=pl.String),
                      False: pl.Series("request_id", [], dtype=pl.String)}

    def first(self, frame: pl.DataFrame) -> pl.DataFrame:
        """``frame`` (requests rows with ``request_id`` and ``observer``) without the rows whose request
        another side already reported."""
        if frame.height == 0:
            return frame
        outside = pl.col("observer").eq_missing(c.OBSERVER_GATEWAY)
        if not frame.select(outside.any()).item() and self._seen[True].len() == 0:
            self._remember(frame, False)  # no gateway yet: nothing to pair, only remember
            return frame
        inside_ids = frame.filter(~outside)["request_id"]
        kept = frame.filter(
            pl.when(outside)
            .then(~pl.col("request_id").is_in(self._seen[False].append(inside_ids).implode()))
            .otherwise(~pl.col("request_id").is_in(self._seen[True].implode())))
        self._remember(frame, True)
        self._remember(frame, False)
        return kept

    def _remember(self, frame: pl.DataFrame, outside: bool) -> None:
        side = pl.col("observer").eq_missing(c.OBSERVER_GATEWAY)
        ids = frame.filter(side if outside else ~side)["request_id"]
        if ids.len():
            self._seen[outside] = self._seen[outside].append(ids).tail(self.remember)
