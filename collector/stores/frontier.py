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

from tokentrace.collector.stores import _frontier


def salt(instance_id: str | None, source: str | None) -> int:
    """A stable 64-bit number for one (instance, source) pair, mixed into the block hash's key."""
    text = "\x00".join("\x01" if part is None else "\x02" + part for part in (instance_id, source))
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


class RecentKeys(_frontier.RecentKeys):
    """64-bit keys recorded lately, in two generations of about ``capacity`` keys each: a key in
    either is a repeat, every key offered joins the new generation (so recurring keys stay), and
    when the new generation is full the old one is dropped (hash tables in C: collector/stores/frontier.c;
    sorting every block of a merge in numpy cost 13 us an engine span)."""

    def fresh(self, keys: np.ndarray) -> np.ndarray:
        """Mask of the (distinct) ``keys`` not recorded lately; all of them count as recorded now."""
        return np.frombuffer(super().fresh(np.ascontiguousarray(keys, dtype=np.uint64)), dtype=bool)


def _codes(column: pa.ChunkedArray) -> tuple[np.ndarray, list]:
    """Each row's index into the column's distinct values (the last index for NULL), and those values."""
    encoded = pc.dictionary_encode(column.combine_chunks())
    values = encoded.dictionary.to_pylist()
    return encoded.indices.fill_null(len(values)).to_numpy().astype(np.int64), [*values, None]


def _salts(staged: pa.Table) -> np.ndarray:
    """The salt (``salt``) of each row's instance and source, one hash per distinct pair."""
    instances, instance_values = _codes(staged.column("instance_id"))
    sources, source_values = _codes(staged.column("source"))
    pairs, row_pair = np.unique(instances * len(source_values) + sources, return_inverse=True)
    per_pair = [salt(instance_values[p // len(source_values)], source_values[p % len(source_values)]) for p in pairs]
    return np.array(per_pair, dtype=np.uint64)[row_pair.reshape(-1)]


def fresh_frontiers(staged: pa.Table, recent: RecentKeys) -> tuple[pa.Array, pa.Array]:
    """``fresh_from`` and ``fresh_hash`` (both NULL where nothing is new) of the packed
    ``prefix_blocks`` rows ``staged``, taken as if written in order of time (ties: staged order),
    each block new unless ``recent`` has its key or an earlier staged row had it."""
    rows = staged.num_rows
    lists = staged.column("hashes").combine_chunks()
    offsets = lists.offsets.to_numpy().astype(np.int64)
    starts = offsets - offsets[0]  # an Array may be a slice of a larger one
    hashes = np.ascontiguousarray(pc.list_flatten(lists).to_numpy(), dtype=np.int64)
    salts = _salts(staged)
    order = np.argsort(staged.column("t_ns").to_numpy(), kind="stable").astype(np.int64)
    fresh_from = np.frombuffer(recent.frontiers(hashes, starts, salts, order), dtype=np.int32)
    missing = fresh_from < 0
    at = np.minimum(starts[:-1] + np.where(missing, 0, fresh_from), max(len(hashes) - 1, 0))
    values = hashes[at] if len(hashes) else np.zeros(rows, dtype=np.int64)
    return pa.array(fresh_from, pa.int32(), mask=missing), pa.array(values, pa.int64(), mask=missing)
