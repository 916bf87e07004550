"""The engine's prefix cache on real mlx-lm KVCache layers: reuse, LRU, limits, reasons."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from tokentrace.engine_shim.mlx.prompt_cache import PrefixCache, common_prefix

HEADS, DIM, LAYERS = 2, 4, 2
BYTES_PER_TOKEN = 2 * LAYERS * HEADS * DIM * 4  # keys and values, float32


def _layers(tokens: list[int]) -> list[KVCache]:
    """Per-layer caches whose key for position i is the token id (so slices can be checked)."""
    layers = []
    for _ in range(LAYERS):
        cache = KVCache()
        values = mx.broadcast_to(mx.array(tokens, dtype=mx.float32)[None, None, :, None], (1, HEADS, len(tokens), DIM))
        cache.keys, cache.values, cache.offset = mx.array(values), mx.array(values), len(tokens)
        layers.append(cache)
    return layers


def _insert(cache: PrefixCache, tokens: list[int], rid: str):
    return cache.insert(tokens, _layers(tokens), rid)


def test_common_prefix():
    import numpy as np

    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4])) == 2
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert common_prefix(np.array([], dtype=np.int64), np.array([1])) == 0


def test_miss_then_block_rounded_prefix_reuse():
    cache = PrefixCache(max_entries=4, max_bytes=1 << 30)
    base = list(range(100, 150))
    assert cache.lookup(base).kind == "none"
    _insert(cache, base, "r1")
    hit = cache.lookup([*base[:40], 7, 8, 9])
    assert (hit.kind, hit.reused, hit.entry.request_id) == ("prefix", 32, "r1")
    assert [layer.offset for layer in hit.layers] == [32, 32]
    assert hit.layers[0].keys[0, 0, :, 0].tolist() == base[:32]
    assert (hit.entries, hit.nbytes) == (1, 50 * BYTES_PER_TOKEN)


def test_whole_prompt_found_leaves_one_token_to_compute():
    cache = PrefixCache(max_entries=4, max_bytes=1 << 30)
    _insert(cache, list(range(64)), "r1")
    hit = cache.lookup(list(range(64)))
    assert (hit.kind, hit.reused) == ("exact", 63)
    assert cache.lookup(list(range(10))).kind == "none"  # under one block: nothing worth reusing


def test_reused_slices_are_independent_of_the_stored_entry():
    cache = PrefixCache(max_entries=4, max_bytes=1 << 30)
    _insert(cache, list(range(48)), "r1")
    hit = cache.lookup(list(range(40)))
    hit.layers[0].update_and_fetch(mx.zeros((1, HEADS, 3, DIM)), mx.zeros((1, HEADS, 3, DIM)))
    again = cache.lookup(list(range(48)))
    assert again.layers[0].keys[0, 0, :, 0].tolist() == list(range(47))


def test_entry_limit_evicts_least_recently_used_with_reason():
    cache = PrefixCache(max_entries=2, max_bytes=1 << 30)
    for i in range(2):
        _insert(cache, [i] * 20, f"r{i}")
    cache.lookup([0] * 20)  # r0 becomes most recently used
    inserted = _insert(cache, [2] * 20, "r2")
    assert [(e.entry.request_id, e.reason) for e in inserted.evictions] == [("r1", "max_entries")]
    assert (inserted.entries_after, inserted.max_entries) == (2, 2)
    assert inserted.evictions[0].entries_after == 2


def test_byte_limit_evicts_until_under():
    cache = PrefixCache(max_entries=10, max_bytes=50 * BYTES_PER_TOKEN)
    _insert(cache, [1] * 20, "a")
    _insert(cache, [2] * 20, "b")
    inserted = _insert(cache, [3] * 20, "c")
    assert [(e.entry.request_id, e.reason) for e in inserted.evictions] == [("a", "max_bytes")]
    assert inserted.bytes_after == 40 * BYTES_PER_TOKEN == cache.nbytes


def test_a_longer_entry_supersedes_its_prefixes():
    cache = PrefixCache(max_entries=10, max_bytes=1 << 30)
    _insert(cache, list(range(20)), "turn1")
    inserted = _insert(cache, list(range(30)), "turn2")
    assert [(e.entry.request_id, e.reason) for e in inserted.evictions] == [("turn1", "superseded")]
    assert len(cache) == 1


@pytest.mark.parametrize("limit", [0, 1])
def test_tiny_limits_never_keep_more_than_allowed(limit):
    cache = PrefixCache(max_entries=limit, max_bytes=1 << 30)
    inserted = _insert(cache, [1] * 20, "r")
    assert len(cache) == limit
    assert len(inserted.evictions) == 1 - limit
