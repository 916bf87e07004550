"""Exactly once per span, whatever the sender retries (issue 11 item 2).

An OTLP exporter that lost an acknowledgement sends the same request again; the engine shim resends
a spool file over HTTP that the collector may also find in its spool directory; a sender retries a
batch that a collector killed with -9 had committed. Each carries the same spans, so the store keeps
a span only if no span with its **(trace id, span id)** is stored yet: the OTLP identity of a span
(trace.proto: "span_id ... unique within a trace"). Every typed table derives from spans, so the
check runs once per span, before any row is written, and the rows of a known span are all dropped
(``select``): requests, phases, steps, heartbeats, block hashes, sightings, resources alike.

Finding out cheaply which spans are stored (``SpanKeys``): a B-tree or ART index on 48 hex
characters per span costs more than the rest of the write (measured with DuckDB 1.x on this
machine: 55k keys/s with a primary key, and 1.8 s per batch of 10k known keys through ON CONFLICT).
A resent span has the span's own end time, so the collector keeps, in memory, a 64-bit hash of the
key of every stored span that ended after a horizon, with the 10-second bucket of its end time and
the low 32 bits of that end time as a check, in a hash table in C (collector/stores/spankeys.c: 16 bytes a
slot, at most 3/4 of the slots used, 85 MiB for ``capacity`` spans; before a batch would pass the
capacity, the oldest buckets are dropped down to three quarters of it). Then:

- a span ending after the horizon whose hash is not in memory is new: no query at all (the
  common case);
- a span whose hash is in memory with its check is stored already: dropped, no query (a resend);
- a span whose hash is in memory with another check, or that ends before the horizon and is not
  remembered (late data, an old spool file), is looked up in the store by its trace id and exact
  start time (named query ``span_keys``), and compared by its full ids.

A new span is taken for a stored one only if its 64-bit hash equals a remembered span's (with 4M
remembered, about once in 2**64 / 4M = 4e12 new spans) and its end time agrees with that span's in
the low 32 bits of its nanoseconds as well (with clocks of nanosecond resolution, once in 2e22; a
clock of millisecond resolution leaves 26 of those bits). Trace ids are random, so nobody can aim a
collision at another sender's spans. The store was asked for every remembered hash before (issue 17):
a sender that resent stored batches cost the writer ~150 us a span, and every other sender waited
on it (bench/resend.py: 22-32k new spans/s beside one sender resending 5.5-8.1k spans/s, against
56-95k alone; 43-51k with the check).

At start the memory is filled from the store's newest minutes (named queries ``span_key_minutes``
and ``span_keys_since``), so a resend after a restart is recognised too. Spans repeated within one
batch keep their first copy.

Why buckets of 10 seconds and a hash table (issue 17): the memory was sorted arrays per minute,
folded (sorted again whole) every ninth batch of the minute, which cost the writer 1 us a span
with 1M keys in the minute and 4 us with 4M (a microbenchmark of its calls; docs/benchmarks.md);
at 100k spans/s a minute holds 6M spans, more than the capacity, so the current minute itself was
dropped and every later span of it looked up in the store. A bucket of 10 s holds 1M at that rate.

Why end times (issue 17): a span is exported when it ends, so its end time follows its arrival,
while its start time is as old as the work it measures. The buckets were of start times: at 100k
spans/s the capacity holds about 40 s, so every span of a request that ran longer (an llm.request
of a long generation, its llm.decode) started before the horizon and sent its batch to the store
for a lookup: 2.3 ms for one span on a store of 10M spans, 0.4 ms a span for more, on the writer
thread that every sender waits on. By end time, only data that arrives late is looked up.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import polars as pl

from tokentrace.collector.decoding.columns import Columns
from tokentrace.collector.stores import _spankeys

MINUTE_NS = 60_000_000_000
#: End times are kept by bucket of this many nanoseconds (a divisor of a minute).
BUCKET_NS = 10_000_000_000
_PER_MINUTE = MINUTE_NS // BUCKET_NS
#: Spans held at most: 85 MiB of slots when full (4M keys in 5.3M slots of 16 bytes).
DEFAULT_CAPACITY = 4_000_000
#: Buckets held at most (end times spread over years by a sender's clock): the oldest go first.
MAX_BUCKETS = 65_536
#: Spans looked up in the store per query (each binds its start times and trace ids as values).
LOOKUP_SPANS = 2_000
_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(0x165667B19E3779F9))

#: KeyTable.match: the hash is held with the span's check (stored), or with another one (ask the store).
_REMEMBERED, _OTHER_CHECK = 1, 2
#: (start times, trace ids) -> the (trace id, span id) pairs stored with those.
Lookup = Callable[[list[int], list[str]], set[tuple[str, str]]]


def key_hashes(trace_ids: list[str], span_ids: list[str]) -> np.ndarray:
    """64-bit hashes of the keys (lower-case hex ids, as every store keeps them), vectorized."""
    words = np.concatenate([
        np.frombuffer(np.array(trace_ids, dtype="S32").tobytes(), dtype="<u8").reshape(-1, 4),
        np.frombuffer(np.array(span_ids, dtype="S16").tobytes(), dtype="<u8").reshape(-1, 2),
    ], axis=1)
    h = np.zeros(len(words), dtype=np.uint64)
    for column in range(words.shape[1]):
        h = (h ^ words[:, column]) * _MIX[column % 3]
        h ^= h >> np.uint64(29)
    return h


class SpanKeys:
    """The keys of stored spans that ended in or after bucket ``horizon`` (module docstring)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_buckets: int = MAX_BUCKETS):
        self.capacity, self.max_buckets = capacity, max_buckets
        self._table = _spankeys.KeyTable(max_slots=capacity * 4 // 3 + 1)
        self._counts: dict[int, int] = {}  # bucket -> keys held
        #: Spans ending before this bucket (end_ns // BUCKET_NS) may be stored without being in memory.
        self.horizon = -(2**62)

    def load(self, minute_counts: pl.DataFrame, since: Callable[[int], pl.DataFrame]) -> None:
        """Fill from a store: its newest minutes (``minute, spans``) up to half the capacity."""
        taken, horizon = 0, None
        for minute, spans in minute_counts.sort("minute", descending=True).iter_rows():
            if taken + spans > self.capacity // 2:
                break
            taken, horizon = taken + spans, minute
        if horizon is None:
            self.horizon = (minute_counts["minute"].max() + 1) * _PER_MINUTE if minute_counts.height else -(2**62)
            return
        rows = since(horizon * MINUTE_NS)
        self.add(key_hashes(rows["trace_id"].to_list(), rows["span_id"].to_list()), rows["end_ns"].to_numpy())
        self.horizon = max(self.horizon, horizon * _PER_MINUTE)

    def __len__(self) -> int:
        return len(self._table)

    @property
    def nbytes(self) -> int:
        """Memory the table's slots take."""
        return self._table.nbytes

    def fresh(self, batch: Columns, stored: Lookup) -> np.ndarray:
        """Mask of the spans of ``batch`` to store: not stored yet, and first of their key in it."""
        if not batch.spans:
            return np.zeros(0, dtype=bool)
        spans = batch.tables["spans"]
        hashes, ends = batch.keys, spans.column("end_ns").to_numpy()
        keep = _first_of_each(hashes, spans)
        held = np.frombuffer(self._table.match(np.ascontiguousarray(hashes, dtype=np.uint64), _checks(ends)),
                             dtype=np.uint8)
        keep &= held != _REMEMBERED
        doubt = keep & ((held == _OTHER_CHECK) | (ends // BUCKET_NS < self.horizon))
        if not doubt.any():
            return keep
        asked = np.flatnonzero(doubt)
        keep[asked[in_store(spans, asked, stored)]] = False
        return keep

    def add(self, hashes: np.ndarray, ends: np.ndarray) -> None:
        """Record the key hashes (``key_hashes``) of spans just committed, by their end times.
        Where they would take the memory past the capacity (or ``max_buckets``), the oldest buckets
        go first, theirs included, down to three quarters of it."""
        buckets = np.asarray(ends, dtype=np.int64) // BUCKET_NS
        incoming = dict(zip(*(part.tolist() for part in np.unique(buckets[buckets >= self.horizon],
                                                                      return_counts=True)), strict=True))
        if (len(self._table) + sum(incoming.values()) > self.capacity
                or len(self._counts.keys() | incoming.keys()) > self.max_buckets):
            self._drop_oldest(incoming)
        checks = _checks(ends)
        kept = buckets >= self.horizon
        if not kept.all():
            hashes, buckets, checks = hashes[kept], buckets[kept], checks[kept]
        if not len(hashes):
            return
        added = np.frombuffer(self._table.add(np.ascontiguousarray(hashes, dtype=np.uint64),
                                              buckets.astype(np.int32), checks), dtype=bool)
        for bucket, count in zip(*np.unique(buckets[added], return_counts=True), strict=True):
            self._counts[int(bucket)] = self._counts.get(int(bucket), 0) + int(count)

    def _drop_oldest(self, incoming: dict[int, int]) -> None:
        """Raise the horizon past the oldest buckets, held or ``incoming`` (bucket -> keys), until
        what is left of both fits three quarters of the capacity and of ``max_buckets``."""
        every = sorted(self._counts.keys() | incoming.keys())
        size = len(self._table) + sum(incoming.values())
        horizon = self.horizon
        for at, bucket in enumerate(every):
            if size <= self.capacity * 3 // 4 and len(every) - at <= self.max_buckets * 3 // 4:
                break
            size -= self._counts.pop(bucket, 0) + incoming.get(bucket, 0)
            horizon = bucket + 1
        self.horizon = horizon
        self._table.drop_before(horizon)

    def add_batch(self, batch: Columns) -> None:
        """Record the spans of a batch just committed."""
        if batch.spans:
            self.add(batch.keys, batch.tables["spans"].column("end_ns").to_numpy())

    def _known(self, hashes: np.ndarray) -> np.ndarray:
        """Mask of the hashes held, whatever their bucket and check."""
        return np.frombuffer(self._table.has(np.ascontiguousarray(hashes, dtype=np.uint64)), dtype=bool)


def in_store(spans, rows: np.ndarray, stored: Lookup) -> np.ndarray:
    """Mask over ``rows`` (indices into the Arrow table ``spans``) of the spans the store holds:
    asked by their trace ids and exact start times, ``LOOKUP_SPANS`` spans a query, and compared by
    their full ids."""
    traces, ids = spans.column("trace_id").to_pylist(), spans.column("span_id").to_pylist()
    starts = spans.column("start_ns").to_pylist()
    held = np.zeros(len(rows), dtype=bool)
    for part in np.array_split(np.arange(len(rows)), max(1, -(-len(rows) // LOOKUP_SPANS))):
        if not len(part):
            continue
        chosen = rows[part]
        found = stored(sorted({starts[i] for i in chosen}), sorted({traces[i] for i in chosen}))
        held[part] = [(traces[i], ids[i]) in found for i in chosen]
    return held


def _checks(ends: np.ndarray) -> np.ndarray:
    """The check kept beside each key hash: the low 32 bits of the span's end time."""
    return np.ascontiguousarray(np.asarray(ends, dtype=np.int64).astype(np.uint64) & np.uint64(0xFFFFFFFF),
                                dtype=np.uint32)


def _first_of_each(hashes: np.ndarray, spans) -> np.ndarray:
    """Mask of the first span of each key in a batch (hashes equal, ids compared exactly)."""
    keep = np.ones(len(hashes), dtype=bool)
    # A batch without repeats (the common one) needs a sort alone: 0.016 us a span, against 0.12
    # for np.unique with indexes and counts (issue 17, tenth round).
    ordered = np.sort(hashes)
    if not (ordered[1:] == ordered[:-1]).any():
        return keep
    _, first, counts = np.unique(hashes, return_index=True, return_counts=True)
    traces, ids = spans.column("trace_id").to_pylist(), spans.column("span_id").to_pylist()
    seen: set[tuple[str, str]] = set()
    repeated = np.isin(hashes, np.unique(hashes[first[counts > 1]]))
    for i in np.flatnonzero(repeated):
        key = (traces[i], ids[i])
        keep[i] = key not in seen
        seen.add(key)
    return keep


def drop_stored(batch: Columns, keys: SpanKeys, stored: Lookup) -> None:
    """Leave out of ``batch``, in place, the spans already stored and every row they made; after
    it the batch holds what the store writes (what counters and /metrics then see) and
    ``duplicates`` how many spans were left out."""
    fresh = batch.select(keys.fresh(batch, stored))
    batch.duplicates = batch.spans - fresh.spans
    batch.tables, batch.origin, batch.keys, batch.spans = fresh.tables, fresh.origin, fresh.keys, fresh.spans
    batch.sources = fresh.sources
