"""Issue 17: the compiled decoder on hostile input returns the Python path's Columns or None, and
never crashes or raises: the receiver fuzz's mutations (test_collector_fuzz.py), truncations, bit
flips, huge length prefixes, undefined wire types and nesting deeper than protobuf allows. Seeded
and bounded (a few seconds)."""

from __future__ import annotations

import random
import time

from harness_fastpath import MAX, check, engine_request, mlx_payload, one_span, span_suffix, varint
from test_collector_fuzz import SEED, _mutate_bytes, _mutate_message, _seeds, fuzz_bodies

from tokentrace import contract as c
from tokentrace.collector.receiver.otlp import decompress
from tokentrace.errors import PayloadError


def test_fuzzed_bodies_decode_to_the_reference_or_to_none():
    """The receiver fuzz's bodies (test_collector_fuzz.py: structured and byte-level mutations of
    contract spans), and the same mutations of engine-shaped batches."""
    started, outcomes = time.monotonic(), {True: 0, False: 0}
    for data, content_type, headers in fuzz_bodies(SEED, 1000):
        if content_type != "application/x-protobuf":
            continue
        try:
            data = decompress(data, headers.get("Content-Encoding"), 2_000_000)
        except PayloadError:  # a mutated gzip stream: the receiver's 400, before any decoding
            continue
        outcomes[check(data, 4096) is not None] += 1
    rng = random.Random(SEED)
    for _ in range(200):
        request = engine_request(rng, requests=2)
        _mutate_message(request, rng)
        body = request.SerializeToString()
        outcomes[check(body if rng.random() < 0.5 else _mutate_bytes(body, rng), 4096) is not None] += 1
    for seed in _seeds():
        outcomes[check(seed.SerializeToString()) is not None] += 1
    assert outcomes[True] > 150 and outcomes[False] > 150, outcomes  # both paths exercised
    assert time.monotonic() - started < 60


def _length_prefixes(data: bytes, at: int = 0, end: int | None = None, depth: int = 0) -> list[tuple[int, int]]:
    """(offset, size) of every length prefix in ``data``, reading each length-delimited field as
    a message where it parses as one (a heuristic walk: hostile input needs no exact schema)."""
    end, found = len(data) if end is None else end, []
    while at < end:
        tag, size = _readvarint(data, at)
        if tag is None or tag >> 3 == 0:
            return found
        at += size
        kind = tag & 7
        if kind == 0:
            _, size = _readvarint(data, at)
            at += size or 1
        elif kind in (1, 5):
            at += 8 if kind == 1 else 4
        elif kind == 2:
            length, size = _readvarint(data, at)
            if length is None or at + size + length > end:
                return found
            found.append((at, size))
            if depth < 12:
                found += _length_prefixes(data, at + size, at + size + length, depth + 1)
            at += size + length
        else:
            return found
    return found


def _readvarint(data: bytes, at: int) -> tuple[int | None, int]:
    value = 0
    for i in range(10):
        if at + i >= len(data):
            return None, i
        value |= (data[at + i] & 0x7F) << (7 * i)
        if data[at + i] < 0x80:
            return value, i + 1
    return None, 10


def _nested(depth: int, kind: str) -> bytes:
    """An AnyValue nested ``depth`` deep in arrays or kvlists (protobuf refuses beyond 100)."""
    value = b"\x0a\x04leaf"
    for _ in range(depth):
        if kind == "array":
            value = b"\x2a" + varint(len(value) + 2) + b"\x0a" + varint(len(value)) + value
        else:
            pair = b"\x0a\x01k\x12" + varint(len(value)) + value
            value = b"\x32" + varint(len(pair) + 2) + b"\x0a" + varint(len(pair)) + pair
    return value


def _hostile(body: bytes, rng: random.Random) -> bytes:
    choice = rng.randrange(7) if body else 5
    data = bytearray(body)
    if choice == 0:  # truncated anywhere
        return body[:rng.randrange(len(body) + 1)]
    if choice == 1:  # bits flipped
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    prefixes = _length_prefixes(body)
    if choice in (2, 3) and prefixes:  # a length prefix made huge, or off by a few
        at, size = rng.choice(prefixes)
        length, _ = _readvarint(body, at)
        huge = rng.choice([2**63, 2**64 - 1, 2**31, 2**32 + 5, len(body)])
        new = huge if choice == 2 else max(0, length + rng.choice([-2, -1, 1, 2]))
        return body[:at] + varint(new) + body[at + size:]
    if choice == 4:  # an 11-byte varint, a zero tag, or a wire type protobuf does not define
        junk = rng.choice([b"\x08" + b"\xff" * 10 + b"\x01", b"\x00\x01", b"\x0e\x01", b"\x0f" + bytes(8), b"\x0c"])
        at = rng.choice(prefixes)[0] if prefixes else 0
        return body[:at] + junk + body[at:]
    if choice == 5:  # random bytes
        return rng.randbytes(rng.randrange(1, 64))
    return bytes(data) * 2  # the request twice: resource spans repeat, which is legal


def test_hostile_bytes_give_the_reference_or_none_and_never_crash():
    rng, started = random.Random(SEED), time.monotonic()
    bodies = [engine_request(rng, requests=2).SerializeToString() for _ in range(6)]
    bodies += [seed.SerializeToString() for seed in _seeds()] + [mlx_payload(9)]
    decoded = sum(check(_hostile(rng.choice(bodies), rng), rng.choice([MAX, 4096, 8])) is not None
                  for _ in range(2500))
    assert 200 < decoded < 2000  # some mutations leave a payload the decoder reproduces, most not
    small = one_span(c.SPAN_DECODE, {c.DECODE_STEP_OFFSETS: [0, 5]}).SerializeToString()
    for end in range(len(small)):  # every truncation of one span
        check(small[:end])
    for depth in (1, 5, 99, 100, 101, 3000):  # nesting, below and beyond protobuf's limit
        for kind in ("array", "kvlist"):
            value = _nested(depth, kind)
            attribute = b"\x0a\x01n\x12" + varint(len(value)) + value
            body = span_suffix(b"\x4a" + varint(len(attribute)) + attribute)
            assert (check(body) is None) == (depth > 1 or kind == "kvlist")  # one level: an array of strings
            assert check(span_suffix(b"\xa2\x06" + varint(len(value)) + value)) is not None  # unknown: skipped
    assert time.monotonic() - started < 60
