"""The contract's instance-side encodings, written once for every way in (docs/telemetry.md): the
columnar ``engine.steps`` window, the ``instance.heartbeat`` attributes, the cache state and the
``llm.cache.evict`` event. The MLX engine (``mlx/spans.py``), the vLLM plugin (``vllm/steps.py``,
``vllm/plugin.py``) and the gateway's adapters build their spans from these, so a column or a unit
means the same from every engine.

Pure functions from numbers to attribute dicts; values an engine does not know are passed as None
and left out (unknown is not zero, STYLE §22).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokentrace import contract as c


def _known(attributes: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in attributes.items() if value is not None}


def cache_state(unit: str, entries: int | None, nbytes: int | None) -> dict[str, Any]:
    """What the cache holds at one moment, and what one of its entries is (``c.CACHE_UNITS``)."""
    if unit not in c.ENUMS[c.CACHE_UNIT]:
        raise ValueError(f"cache unit must be one of {c.ENUMS[c.CACHE_UNIT]}, received {unit!r}")
    return _known({c.CACHE_UNIT: unit, c.CACHE_ENTRIES: entries, c.CACHE_BYTES: nbytes})


def steps_window(
    start_ns: Sequence[int],
    duration_ns: Sequence[int],
    prefill_seqs: Sequence[int],
    decode_seqs: Sequence[int],
    prefill_tokens: Sequence[int],
    decode_tokens: Sequence[int],
    members: Sequence[str] | None = None,
) -> tuple[int, int, dict[str, Any]]:
    """(start, end, attributes) of one ``engine.steps`` span over steps sorted by start.

    ``members`` lists, per step, the ids of the requests prefilling then decoding in it,
    concatenated; an engine that names no requests per step (vLLM) passes None and the span
    carries no ``requests``/``members``.
    """
    start = start_ns[0]
    end = max(s + d for s, d in zip(start_ns, duration_ns, strict=True))
    attributes: dict[str, Any] = {
        c.STEPS_COUNT: len(start_ns),
        c.STEPS_START_OFFSETS: [t - start for t in start_ns],
        c.STEPS_DURATIONS: list(duration_ns),
        c.STEPS_PREFILL_SEQS: list(prefill_seqs),
        c.STEPS_DECODE_SEQS: list(decode_seqs),
        c.STEPS_PREFILL_TOKENS: list(prefill_tokens),
        c.STEPS_DECODE_TOKENS: list(decode_tokens),
    }
    if members is not None:
        index: dict[str, int] = {}
        attributes[c.STEPS_MEMBERS] = [index.setdefault(rid, len(index)) for rid in members]
        attributes[c.STEPS_REQUESTS] = list(index)
    return start, end, attributes


def heartbeat(
    *,
    unit: str,
    queue_depth: int | None,
    running: int | None,
    max_batch: int | None = None,
    cache_entries: int | None = None,
    cache_bytes: int | None = None,
    cache_max_entries: int | None = None,
    cache_max_bytes: int | None = None,
    kv_bytes_per_token: int | None = None,
    memory_bytes: int | None = None,
    memory_free: int | None = None,
) -> dict[str, Any]:
    """Attributes of one ``instance.heartbeat``; ``unit`` says what the cache's entries count."""
    return {
        **_known({c.QUEUE_DEPTH: queue_depth, c.QUEUE_RUNNING: running, c.MAX_BATCH: max_batch}),
        **cache_state(unit, cache_entries, cache_bytes),
        **_known({
            c.CACHE_MAX_ENTRIES: cache_max_entries, c.CACHE_MAX_BYTES: cache_max_bytes,
            c.KV_BYTES_PER_TOKEN: kv_bytes_per_token, c.MEMORY_BYTES: memory_bytes, c.MEMORY_FREE: memory_free,
        }),
    }


def eviction(
    *,
    unit: str,
    tokens: int,
    reason: str,
    fingerprint: int | None = None,
    nbytes: int | None = None,
    request_id: str | None = None,
    entries_after: int | None = None,
    bytes_after: int | None = None,
) -> dict[str, Any]:
    """Attributes of one ``llm.cache.evict`` event: the entry that left and the cache after it."""
    if reason not in c.ENUMS[c.EVICT_REASON]:
        raise ValueError(f"eviction reason must be one of {c.ENUMS[c.EVICT_REASON]}, received {reason!r}")
    return {
        **_known({
            c.ENTRY_FINGERPRINT: fingerprint, c.ENTRY_TOKENS: tokens, c.ENTRY_BYTES: nbytes,
            c.ENTRY_REQUEST_ID: request_id, c.EVICT_REASON: reason,
        }),
        **cache_state(unit, entries_after, bytes_after),
    }


def prompt_lookup(
    *,
    request_id: str,
    prompt_length: int,
    block_size: int,
    hashes: Sequence[int],
    matched: int | None,
    segments: Sequence[tuple[str, int, int, int, int]] = (),
    snippets: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Attributes of an ``llm.cache.lookup`` built by an observer outside the engine's cache (the
    gateway, the vLLM plugin): the prompt's fingerprint, its segments as (role, start, end, content
    hash, tail hash), and the tokens the engine reused (None: unknown, left out)."""
    attributes: dict[str, Any] = {
        c.REQUEST_ID: request_id, c.CACHE_PROMPT_TOKENS: prompt_length, c.CACHE_BLOCK_SIZE: block_size,
        c.CACHE_BLOCK_HASHES: list(hashes),
    }
    if matched is not None:
        attributes[c.CACHE_MATCHED_TOKENS] = matched
        attributes[c.CACHE_MATCH] = c.MATCH_PREFIX if matched else c.MATCH_NONE
    if segments:
        roles, starts, ends, content, tails = (list(column) for column in zip(*segments, strict=True))
        attributes.update({c.SEGMENT_ROLES: roles, c.SEGMENT_STARTS: starts, c.SEGMENT_ENDS: ends,
                           c.SEGMENT_HASHES: content, c.SEGMENT_TAIL_HASHES: tails})
        if snippets is not None:
            attributes[c.SEGMENT_SNIPPETS] = list(snippets)
    return attributes


def prompt_insert(*, request_id: str, prompt_length: int, block_size: int, held: Sequence[int]) -> dict[str, Any]:
    """Attributes of the ``llm.cache.insert`` such an observer infers once the engine served the
    prompt: it now holds the prompt's blocks ``held`` (those the engine caches whole)."""
    return {c.REQUEST_ID: request_id, c.ENTRY_FINGERPRINT: held[-1],
            c.ENTRY_TOKENS: min(prompt_length, len(held) * block_size), c.CACHE_BLOCK_SIZE: block_size,
            c.CACHE_BLOCK_HASHES: list(held)}
