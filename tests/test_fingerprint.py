"""Chained block hashes: stable, prefix-identifying, and spec-conformant."""

import hashlib
import struct
import subprocess
import sys

from tokentrace.fingerprint import block_hashes, segment_hash, to_signed


def test_hash_follows_the_documented_formula():
    tokens = list(range(20))
    first = hashlib.blake2b(struct.pack(">Q", 0) + struct.pack("<16I", *tokens[:16]), digest_size=8)
    h0 = int.from_bytes(first.digest(), "big")
    second = hashlib.blake2b(struct.pack(">Q", h0) + struct.pack("<4I", *tokens[16:]), digest_size=8)
    h1 = int.from_bytes(second.digest(), "big")
    assert block_hashes(tokens, 16) == [to_signed(h0), to_signed(h1)]


def test_prefix_shares_hashes_and_divergence_changes_all_later_ones():
    base = list(range(100, 164))
    changed = base.copy()
    changed[20] = 7
    a, b = block_hashes(base), block_hashes(changed)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))
    assert block_hashes(base[:48]) == a[:3]


def test_hashes_are_stable_across_processes():
    code = "from tokentrace.fingerprint import block_hashes; print(block_hashes(list(range(50))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(block_hashes(list(range(50))))


def test_segment_hash_ignores_position_but_not_content():
    assert segment_hash([5, 6, 7]) == segment_hash([5, 6, 7])
    assert segment_hash([5, 6, 7]) != segment_hash([5, 6, 8])
    assert all(-(1 << 63) <= h < (1 << 63) for h in block_hashes(list(range(1000))))
