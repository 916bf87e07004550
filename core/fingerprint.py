"""Prefix fingerprints: chained block hashes and segment content hashes (docs/telemetry.md).

Stable across processes and machines, so two instances serving the same model produce the same
fingerprint for the same prefix; that is what makes an instance change detectable.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

from tokentrace.contract import DEFAULT_BLOCK_SIZE

_U64 = struct.Struct(">Q")
_MASK = (1 << 64) - 1


def to_signed(value: int) -> int:
    """An unsigned 64-bit digest as the signed int64 OTLP carries."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _token_bytes(tokens: Sequence[int]) -> bytes:
    data = array("I", tokens)  # 32-bit unsigned on every platform CPython supports
    if data.itemsize != 4:
        raise RuntimeError(f"array('I') has {data.itemsize}-byte items; 4 expected")
    if struct.pack("=I", 1) != struct.pack("<I", 1):
        data.byteswap()
    return data.tobytes()


def _digest(payload: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "big")


def block_hashes(
    tokens: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE, prev: int = 0
) -> list[int]:
    """Chained hashes, one per block of ``block_size`` tokens (the last block may be shorter).

    Returned as signed int64; ``h[i]`` identifies ``tokens[: (i + 1) * block_size]``. ``prev``
    continues a chain: the (signed) hash of the whole-block prefix that precedes ``tokens``, for
    callers that learn a prompt block by block (vLLM's KV events carry only the new blocks).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    raw = _token_bytes(tokens)
    step = 4 * block_size
    hashes: list[int] = []
    prev &= _MASK
    for start in range(0, len(raw), step):
        prev = _digest(_U64.pack(prev) + raw[start : start + step])
        hashes.append(to_signed(prev))
    return hashes


def segment_hash(tokens: Sequence[int]) -> int:
    """Content hash of one segment's token ids, independent of where the segment sits."""
    return to_signed(_digest(_token_bytes(tokens)))


def segment_tail_hash(tokens: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Content hash of a segment's last ``block_size`` token ids, or 0 for a segment under two
    blocks. Two messages that end alike but differ before (a timestamp at the start of a system
    prompt) share it where their own hashes and every prefix block differ: the cache verdict
    tells an edited message from a new one by it."""
    if len(tokens) < 2 * block_size:
        return 0
    return to_signed(_digest(_token_bytes(tokens[-block_size:]))) or 1


def message_spans(whole: Sequence[int], prefixes: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """The token span of each chat message in the prompt ``whole``, given the rendering of the first
    k messages (no generation prompt) as ``prefixes[k - 1]``: message k ends where that rendering
    stops sharing tokens with the whole prompt (never before the previous message's end)."""
    spans, start = [], 0
    for prefix in prefixes:
        n = min(len(prefix), len(whole))
        shared = next((i for i in range(n) if prefix[i] != whole[i]), n)
        end = max(shared, start)
        spans.append((start, end))
        start = end
    return spans


def held_hashes(hashes: list[int], length: int, engine_block: int | None,
                block_size: int = DEFAULT_BLOCK_SIZE) -> list[int]:
    """The block hashes of a ``length``-token prompt that an engine caching whole blocks of
    ``engine_block`` tokens (vLLM's paged cache) can hold: those of its complete engine blocks."""
    if not engine_block or engine_block <= 1:
        return hashes
    return hashes[: length // engine_block * engine_block // block_size]


def full_blocks(token_count: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """How many complete blocks ``token_count`` tokens fill."""
    return token_count // block_size
