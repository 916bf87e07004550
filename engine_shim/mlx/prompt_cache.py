"""The engine's prefix-reusing prompt cache, built on mlx-lm's public cache primitives.

Why not mlx-lm's ``LRUPromptCache``: it has no hooks, so observing its evictions means wrapping the
private ``_trie.pop``/``pop_prefixes`` and inferring the reason after the fact (notes §4); its
eviction order is per cache *type*, and its lookups deep-copy whole entries. This cache is small
enough to own outright: every lookup, insert and eviction returns a plain record with its reason,
and it only uses ``KVCache`` (keys/values/offset) and ``make_prompt_cache`` from mlx-lm.

Policy: LRU over entries (a hit refreshes its entry); an insert first drops the entries it extends
(reason ``superseded``: a longer entry serves every lookup the shorter one could), then evicts the
least recently used entries while over ``max_entries`` (``max_entries``) or ``max_bytes``
(``max_bytes``). Reuse is rounded down to whole fingerprint blocks, like vLLM's block-granular
prefix caching, so ``cached_tokens`` compares across engines and with the block hashes; at least
one prompt token is always left to compute, because the last prompt token's logits are needed.

Bytes: an entry counts its layers' bytes. A distributed engine's rank 0 (cluster.py) holds only its
own share of each entry's KV while every rank caches the same entries, so its cache counts each entry
as the rank holding the most KV per token does (``scale``: the entry's bytes here x that rank's KV
bytes per token // this rank's, exact where both shares are whole per-layer sizes, as they are): the
byte limit, and every byte figure the cache reports, are that rank's. On one process the scale is 1.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokentrace.contract import (
    DEFAULT_BLOCK_SIZE,
    EVICT_MAX_BYTES,
    EVICT_MAX_ENTRIES,
    EVICT_SUPERSEDED,
    MATCH_EXACT,
    MATCH_NONE,
    MATCH_PREFIX,
)
from tokentrace.engine_shim.mlx.records import EvictionRecord, InsertRecord, LookupRecord


@dataclass(eq=False)
class CacheEntry:
    """One stored KV cache: the keys/values of ``tokens`` in every layer."""

    tokens: list[int]  #: token ids the KV covers (prompt and generated)
    layers: list[Any]  #: one mlx-lm ``KVCache`` per layer holding exactly ``len(tokens)`` positions
    nbytes: int  #: bytes of keys and values, as the cache counts them (``PrefixCache`` scale)
    request_id: str  #: the request whose tokens these are
    array: np.ndarray = field(init=False, repr=False)  #: ``tokens`` as int64, for prefix matching
    id: int = field(default_factory=itertools.count().__next__)  #: names the entry to a distributed engine's ranks

    def __post_init__(self) -> None:
        self.array = np.asarray(self.tokens, dtype=np.int64)


@dataclass
class Lookup:
    """What a lookup found and what it hands to the generator."""

    layers: list[Any] | None  #: per-layer caches holding the reused prefix; None when nothing is reused
    reused: int  #: prompt tokens reused
    kind: str  #: contract match kind: exact (whole prompt found), prefix, none
    entry: CacheEntry | None  #: the entry reused
    entries: int  #: entries in the cache at lookup
    nbytes: int  #: bytes in the cache at lookup


@dataclass
class Eviction:
    """An entry pushed out of the cache."""

    entry: CacheEntry  #: the evicted entry
    reason: str  #: contract evict reason
    entries_after: int  #: entries left after this eviction
    bytes_after: int  #: bytes left after this eviction


@dataclass
class Insertion:
    """The outcome of storing one entry."""

    entry: CacheEntry  #: the entry stored (it may itself be among the evictions when over max_bytes)
    evictions: list[Eviction]  #: in the order they happened
    entries_after: int  #: entries after the insert and its evictions
    bytes_after: int  #: bytes after the insert and its evictions
    max_entries: int  #: entry limit in force
    max_bytes: int  #: byte limit in force


def lookup_record(lookup: Lookup) -> LookupRecord:
    """The plain summary of a lookup that telemetry records (no arrays)."""
    tokens = lookup.entry.tokens if lookup.entry is not None else None
    return LookupRecord(lookup.reused, lookup.kind, lookup.entries, lookup.nbytes, tokens)


def insert_record(insertion: Insertion, limit_rank: int | None = None) -> InsertRecord:
    """The plain summary of an insert and its evictions (no arrays); ``limit_rank``: a distributed
    rank 0's declaration of the rank whose bytes its cache counts."""
    evictions = [EvictionRecord(e.entry.tokens, e.entry.nbytes, e.entry.request_id, e.reason, e.entries_after,
                                e.bytes_after) for e in insertion.evictions]
    entry = insertion.entry
    return InsertRecord(entry.tokens, entry.nbytes, insertion.entries_after, insertion.bytes_after,
                        insertion.max_entries, insertion.max_bytes, evictions, limit_rank)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(a.shape[0], b.shape[0])
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if mismatch.size else n


def is_cacheable(layers: Sequence[Any]) -> bool:
    """Whether a model's per-layer caches are plain ``KVCache`` objects that this cache can slice."""
    from mlx_lm.models.cache import KVCache

    return bool(layers) and all(type(layer) is KVCache for layer in layers)


class PrefixCache:
    """LRU prompt cache with entry and byte limits; every operation reports what it did.

    Used from one thread only (the generation thread owns it).
    """

    def __init__(self, max_entries: int, max_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 scale: tuple[int, int] = (1, 1)):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.block_size = block_size
        #: (numerator, denominator): an entry counts its layers' bytes x numerator // denominator
        #: (module docstring: a distributed rank 0 counts the bytes of the rank holding the most)
        self.scale = scale
        self.nbytes = 0
        self._entries: dict[CacheEntry, None] = {}  # insertion order = LRU order (oldest first)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int]) -> Lookup:
        """Find the entry sharing the longest prefix with ``prompt`` and slice its reusable part."""
        entries, nbytes = len(self._entries), self.nbytes
        if not prompt or not self._entries:
            return Lookup(None, 0, MATCH_NONE, None, entries, nbytes)
        query = np.asarray(prompt, dtype=np.int64)
        best, best_len = None, 0
        for entry in self._entries:
            length = common_prefix(entry.array, query)
            if length > best_len:
                best, best_len = entry, length
        reused = min(best_len - best_len % self.block_size, len(prompt) - 1)
        if best is None or reused <= 0:
            return Lookup(None, 0, MATCH_NONE, None, entries, nbytes)
        self._touch(best)
        kind = MATCH_EXACT if best_len == len(prompt) else MATCH_PREFIX
        return Lookup(_slice_layers(best.layers, reused), reused, kind, best, entries, nbytes)

    def own(self, counted: int) -> int:
        """``counted`` bytes (as this cache counts them) in this process's own bytes."""
        return counted * self.scale[1] // self.scale[0]

    def insert(self, tokens: list[int], layers: list[Any], request_id: str) -> Insertion:
        """Store ``layers`` (the KV of ``tokens``) and evict what the limits require."""
        nbytes = sum(layer.nbytes for layer in layers) * self.scale[0] // self.scale[1]
        entry = CacheEntry(tokens, layers, nbytes, request_id)
        evictions: list[Eviction] = []
        for old in list(self._entries):
            if old.array.shape[0] <= entry.array.shape[0] and (
                common_prefix(old.array, entry.array) == old.array.shape[0]
            ):
                evictions.append(self._evict(old, EVICT_SUPERSEDED))
        self._entries[entry] = None
        self.nbytes += nbytes
        while len(self._entries) > self.max_entries:
            evictions.append(self._evict(next(iter(self._entries)), EVICT_MAX_ENTRIES))
        while self.nbytes > self.max_bytes and self._entries:
            evictions.append(self._evict(next(iter(self._entries)), EVICT_MAX_BYTES))
        return Insertion(entry, evictions, len(self._entries), self.nbytes, self.max_entries, self.max_bytes)

    def clear(self) -> None:
        """Drop every entry (no events: used at shutdown)."""
        self._entries.clear()
        self.nbytes = 0

    def _touch(self, entry: CacheEntry) -> None:
        del self._entries[entry]
        self._entries[entry] = None

    def _evict(self, entry: CacheEntry, reason: str) -> Eviction:
        del self._entries[entry]
        self.nbytes -= entry.nbytes
        return Eviction(entry, reason, len(self._entries), self.nbytes)


def _slice_layers(layers: list[Any], length: int) -> list[Any]:
    """Fresh ``KVCache`` objects viewing the first ``length`` positions of ``layers``.

    New array objects, so the generator's in-place cache updates never write into the stored entry
    (mlx-lm's ``BatchKVCache.merge`` copies them into the batch anyway).
    """
    from mlx_lm.models.cache import KVCache

    sliced = []
    for layer in layers:
        cache = KVCache()
        cache.keys = layer.keys[..., :length, :]
        cache.values = layer.values[..., :length, :]
        cache.offset = length
        sliced.append(cache)
    return sliced
