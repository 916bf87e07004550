"""Which blocks of a prompt are new: the first block index of each packed ``prefix_blocks`` row that
no earlier row of the same instance and source had (``fresh_from``), computed as the store appends.

Chained hashes (``h_i = H(h_{i-1} || tokens of block i)``, docs/telemetry.md) make an equal hash at
index i an equal prefix of i + 1 blocks, so a row's new blocks are a suffix of its list: one number
per row says which. The cache verdict asks, of a later prompt, which earlier rows first had its
blocks (sql/duckdb/queries/prefix_reach.sql); those are among the rows whose hash at ``fresh_from``
is one of that prompt's hashes, so one index key per row answers it, instead of one per new block
(20 a span on engine-shaped traffic, which the ART index could not take at 100k spans/s).

"Earlier" is what the store recorded lately (``RecentKeys``: two generations of about a million
keys): a key that comes back after both generations were replaced counts as new again, which marks
a later row as a first holder too. That adds candidates, never hides the first holder, so it
changes no verdict.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_MIX = np.uint64(0x9E3779B97F4A7C15)


def salt(instance_id: str | None, source: str | None) -> int:
    """A stable 64-bit number for one (instance, source) pair, mixed into the block hash's key."""
    text = "\x00".join("\x01" if part is None else "\x02" + part for part in (instance_id, source))
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


class RecentKeys:
    """64-bit keys recorded lately, in two generations of about ``capacity`` keys each: a key in
    either is a repeat, every key offered joins the new generation (so recurring keys stay), and
    when the new generation is full the old one is dropped. Generations are sorted numpy arrays
    probed with ``searchsorted``: a few microseconds per thousand keys."""

    def __init__(self, capacity: int = 1_000_000):
        self.capacity = capacity
        self._new = np.empty(0, dtype=np.uint64)  # sorted
        self._pending: list[np.ndarray] = []  # sorted chunks not yet folded into _new
        self._new_size = 0
        self._old = np.empty(0, dtype=np.uint64)  # sorted

    @staticmethod
    def _among(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
        if not len(sorted_keys):
            return np.zeros(len(keys), dtype=bool)
        at = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
        return sorted_keys[at] == keys

    def fresh(self, keys: np.ndarray) -> np.ndarray:
        """Mask of the (distinct) ``keys`` not recorded lately; all of them count as recorded now."""
        # Probed in sorted order: numpy's binary search then starts from the previous key's place,
        # 5-10 times as fast as random probes into a generation of a million keys (measured).
        order = np.argsort(keys)
        probe = keys[order]
        seen_sorted = self._among(self._old, probe) | self._among(self._new, probe)
        for chunk in self._pending:
            seen_sorted |= self._among(chunk, probe)
        seen = np.empty_like(seen_sorted)
        seen[order] = seen_sorted
        self._pending.append(probe)
        self._new_size += len(keys)
        if len(self._pending) >= 8 or self._new_size >= self.capacity:  # fold: one probe per generation
            self._new, self._pending = _merge(self._new, self._pending), []
        if self._new_size >= self.capacity:
            distinct = np.ones(len(self._new), dtype=bool)
            distinct[1:] = self._new[1:] != self._new[:-1]
            self._old = self._new[distinct]
            self._new, self._new_size = np.empty(0, dtype=np.uint64), 0
        return ~seen


def _merge(sorted_keys: np.ndarray, chunks: list[np.ndarray]) -> np.ndarray:
    """``sorted_keys`` and the ``chunks`` in one sorted array: the small chunks are sorted together
    and inserted in one pass, linear in the generation's size (sorting the whole generation again
    at every fold took a tenth of the writer's time at a million keys)."""
    small = np.sort(np.concatenate(chunks)) if chunks else np.empty(0, dtype=np.uint64)
    return np.insert(sorted_keys, np.searchsorted(sorted_keys, small), small)


def fresh_frontiers(staged: pa.Table, recent: RecentKeys) -> tuple[pa.Array, pa.Array]:
    """``fresh_from`` and ``fresh_hash`` (both NULL where nothing is new) of the packed
    ``prefix_blocks`` rows ``staged``, taken as if written in order of time (ties: staged order),
    each block new unless ``recent`` has its key or an earlier staged row had it."""
    rows = staged.num_rows
    lists = staged.column("hashes").combine_chunks()
    parent = pc.list_parent_indices(lists).to_numpy()
    hashes = pc.list_flatten(lists).to_numpy()
    offsets = lists.offsets.to_numpy().astype(np.int64)
    starts = offsets[:-1] - offsets[0]  # an Array may be a slice of a larger one
    fresh_from = np.full(rows, -1, dtype=np.int64)
    if len(hashes):
        index = np.arange(len(hashes), dtype=np.int64) - starts[parent]
        pairs: dict[tuple, int] = {}
        group = np.fromiter(
            (pairs.setdefault(pair, len(pairs)) for pair in zip(staged.column("instance_id").to_pylist(),
                                                                 staged.column("source").to_pylist(), strict=True)),
            dtype=np.int64, count=rows)
        salts = np.array([salt(*pair) for pair in pairs], dtype=np.uint64)
        keys = (hashes.view(np.uint64) ^ salts[group[parent]]) * _MIX
        keys ^= keys >> np.uint64(31)
        rank = np.empty(rows, dtype=np.int64)
        rank[np.argsort(staged.column("t_ns").to_numpy(), kind="stable")] = np.arange(rows)
        order = np.lexsort((index, rank[parent]))  # the order the blocks are taken in
        unique, first, inverse = np.unique(keys[order], return_index=True, return_inverse=True)
        new = np.zeros(len(keys), dtype=bool)
        new[order[first]] = True  # the first block of each key in that order
        new[order] &= recent.fresh(unique)[inverse]
        holders, at = np.unique(parent[new], return_index=True)  # blocks are in row, then index, order
        fresh_from[holders] = index[new][at]
    missing = fresh_from < 0
    values = hashes[starts + np.where(missing, 0, fresh_from)] if len(hashes) else np.zeros(rows, dtype=np.int64)
    return pa.array(fresh_from.astype(np.int32), pa.int32(), mask=missing), pa.array(values, pa.int64(), mask=missing)
