"""The writer's memory of stored span keys (collector/stores/once.py, collector/stores/spankeys.c): the C table
against a Python set model, and the memory at sustained rates, where sorted arrays per minute once
dropped the current minute whole (issue 17)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from tokentrace.collector.stores._spankeys import KeyTable
from tokentrace.collector.stores.once import BUCKET_NS, MINUTE_NS, SpanKeys, key_hashes

BASE_NS = 1_800_000_000 * 10**9  # a start time late in 2027, on a minute boundary


def _keys(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**64, count, dtype=np.uint64)


def _json_batch(first: int, count: int, start_ns: int, end_ns: int):
    """Parsed OTLP/JSON spans ``first`` .. ``first + count - 1``, ids from their number."""
    from tokentrace.collector.receiver.ingest import parse
    from tokentrace.collector.receiver.otlp import JSON, Encoding

    spans = [{"traceId": f"{i + 1:032x}", "spanId": f"{i + 1:016x}", "name": "work",
              "startTimeUnixNano": str(start_ns + i), "endTimeUnixNano": str(end_ns + i)}
             for i in range(first, first + count)]
    body = {"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [{"spans": spans}]}]}
    data = json.dumps(body).encode()
    return parse(data, Encoding("json", JSON), None, len(data), 65_536)


def test_key_table_agrees_with_a_set_through_growth_and_drops():
    rng = random.Random(7)
    table, model = KeyTable(), {}
    for round_ in range(30):
        keys = [rng.choice([0, 2**64 - 1, rng.getrandbits(64), rng.getrandbits(8)])
                for _ in range(rng.randint(0, 4000))]
        buckets = [rng.randint(-5, 40) for _ in keys]
        checks = [rng.choice([0, 2**32 - 1, rng.getrandbits(32), rng.getrandbits(2)]) for _ in keys]
        added = table.add(np.array(keys, dtype=np.uint64), np.array(buckets, dtype=np.int32),
                          np.array(checks, dtype=np.uint32))
        for key, bucket, check, was_added in zip(keys, buckets, checks, added, strict=True):
            assert was_added == (key not in model)
            model.setdefault(key, (bucket, check))  # a key held keeps its first bucket and check
        if round_ % 7 == 6:
            cut = rng.randint(-5, 40)
            dropped = table.drop_before(cut)
            before = len(model)
            model = {k: held for k, held in model.items() if held[0] >= cut}
            assert dropped == before - len(model)
        assert len(table) == len(model)
        probe = [*rng.sample(sorted(model), min(50, len(model))), *(rng.getrandbits(64) for _ in range(50)), 0]
        got = table.has(np.array(probe, dtype=np.uint64))
        assert list(got) == [int(k in model) for k in probe]
        asked = [model[k][1] if k in model and rng.random() < 0.5 else rng.getrandbits(32) for k in probe]
        found = table.match(np.array(probe, dtype=np.uint64), np.array(asked, dtype=np.uint32))
        assert list(found) == [0 if k not in model else 1 if model[k][1] == c else 2
                               for k, c in zip(probe, asked, strict=True)]


def test_key_table_refuses_bad_buffers():
    table = KeyTable()
    with pytest.raises(ValueError, match="as many items"):
        table.add(np.zeros(3, dtype=np.uint64), np.zeros(2, dtype=np.int32), np.zeros(3, dtype=np.uint32))
    with pytest.raises(ValueError, match="as many items"):
        table.add(np.zeros(3, dtype=np.uint64), np.zeros(3, dtype=np.int32), np.zeros(2, dtype=np.uint32))
    with pytest.raises(ValueError, match="reserved"):
        table.add(np.zeros(1, dtype=np.uint64), np.array([-(2**31)], dtype=np.int32), np.zeros(1, dtype=np.uint32))
    with pytest.raises(ValueError, match="8-byte items"):
        table.has(b"\x00" * 7)
    with pytest.raises(ValueError, match="as many items"):
        table.match(np.zeros(3, dtype=np.uint64), np.zeros(2, dtype=np.uint32))
    with pytest.raises(ValueError, match="4-byte items"):
        table.match(np.zeros(1, dtype=np.uint64), b"\x00" * 6)
    assert len(table) == 0


def test_a_minute_beyond_the_capacity_keeps_its_latest_spans_in_memory():
    """1,200 spans over one minute against a capacity of 1,000: the oldest 10-second buckets go, the
    latest stay, and a new span late in that minute needs no store lookup. The minute memory dropped
    the whole minute, so every later span of it was looked up in the store."""
    keys = SpanKeys(capacity=1000)
    starts = BASE_NS + np.arange(1200, dtype=np.int64) * (MINUTE_NS // 1200)
    hashes = _keys(1200, 1)
    for at in range(0, 1200, 100):  # as the writer records its batches
        keys.add(hashes[at:at + 100], starts[at:at + 100])
    assert len(keys) <= 1000
    assert BASE_NS // BUCKET_NS < keys.horizon <= (BASE_NS + MINUTE_NS // 2) // BUCKET_NS
    late = starts[-1:]
    assert not (late // BUCKET_NS < keys.horizon).any()  # a new span there is judged from memory alone
    assert keys._known(hashes[-100:]).all()
    assert not keys._known(_keys(100, 2)).any()


def test_start_times_spread_over_years_keep_the_buckets_bounded():
    keys = SpanKeys(capacity=10_000, max_buckets=64)
    starts = BASE_NS + np.arange(1000, dtype=np.int64) * 86_400 * 10**9  # a day apart
    keys.add(_keys(1000, 3), starts)
    assert len(keys._counts) <= 48  # down to three quarters of max_buckets
    assert len(keys) == sum(keys._counts.values()) == len(keys._counts)
    assert starts[0] // BUCKET_NS < keys.horizon <= min(keys._counts)  # the oldest went, and no held one
    assert keys._known(_keys(1000, 3)[-48:]).all()  # is older than the horizon


def test_fresh_looks_up_only_what_memory_cannot_rule_out():
    keys, asked = SpanKeys(), []

    def stored(starts, traces):
        asked.append(len(traces))
        return {(f"{i:032x}", f"{i:016x}") for i in range(1, 11)}  # the first ten are stored

    first = _json_batch(0, 10, BASE_NS, BASE_NS + 1000)
    assert keys.fresh(first, stored).all() and not asked  # nothing held: new, no lookup
    keys.add_batch(first)
    again = _json_batch(5, 10, BASE_NS, BASE_NS + 1000)  # five resent, five new
    assert list(keys.fresh(again, stored)) == [False] * 5 + [True] * 5
    assert asked == []  # the five resent are remembered with their end times: no lookup either
    assert len(keys) == 10 and list(key_hashes([f"{1:032x}"], [f"{1:016x}"])) == [first.keys[0]]


def test_key_table_never_takes_more_slots_than_allowed():
    table = KeyTable(max_slots=1400)  # not a power of two: a key's first slot is its hash scaled to it
    assert table.add(_keys(1000, 5), np.zeros(1000, dtype=np.int32), np.zeros(1000, dtype=np.uint32)).count(1) == 1000
    assert table.nbytes == 1400 * 16 and table.has(_keys(1000, 5)).count(1) == 1000
    with pytest.raises(OverflowError, match="1400 slots"):
        table.add(_keys(100, 6), np.zeros(100, dtype=np.int32), np.zeros(100, dtype=np.uint32))  # past 3/4 of them
    assert len(table) == 1000


def test_the_memory_drops_old_buckets_before_a_batch_would_pass_the_capacity():
    keys = SpanKeys(capacity=1000)
    keys.add(_keys(900, 7), np.full(900, BASE_NS))
    keys.add(_keys(300, 8), np.full(300, BASE_NS + BUCKET_NS))  # 1,200 > 1,000: the older bucket goes first
    assert len(keys) == 300 and keys.horizon == BASE_NS // BUCKET_NS + 1
    assert keys._table.nbytes <= (1000 * 4 // 3 + 1) * 16


def test_a_long_request_ending_now_needs_no_store_lookup():
    """Spans of a request that ran for minutes, exported as it ends, arrive with a start time far
    behind the memory's horizon (at 100k spans/s the capacity holds ~40 s). The memory keeps spans
    by end time, so those are judged from memory alone; by start time, every batch holding one went
    to the store (2.3 ms a lookup on a store of 10M spans, on the writer thread)."""
    keys, asked = SpanKeys(capacity=1000), []
    ends = BASE_NS + np.arange(1200, dtype=np.int64) * (MINUTE_NS // 1200)
    for at in range(0, 1200, 100):  # a minute of short spans, recorded batch by batch
        keys.add(_keys(100, 10 + at), ends[at:at + 100])
    assert keys.horizon > BASE_NS // BUCKET_NS + 1
    long_ones = _json_batch(5000, 3, start_ns=BASE_NS - 5 * MINUTE_NS, end_ns=int(ends[-1]))

    def stored(starts, traces):
        asked.append(traces)
        return set()

    assert keys.fresh(long_ones, stored).all() and asked == []
    late = _json_batch(6000, 2, start_ns=BASE_NS - 5 * MINUTE_NS, end_ns=BASE_NS)  # ended before the horizon
    assert keys.fresh(late, stored).all() and len(asked) == 1  # looked up: it may be stored already


def test_a_store_drops_the_resend_of_a_long_span_and_remembers_it_after_a_restart(tmp_path):
    """On a real DuckDB store with a small memory: a span that started long before the horizon and
    ended after it is written without a lookup; its resend is dropped from memory alone (its hash and
    end time remembered), and so is it after a restart (the memory refilled by end time). Before, each
    remembered span was confirmed in the store: ~150 us a span, on the writer thread."""
    from tokentrace.collector.stores.store_duckdb import DuckDBStore

    path = tmp_path / "long.duckdb"
    store = DuckDBStore(path)
    lookups = []
    try:
        store._keys = SpanKeys(capacity=1000)
        looked_up = store._stored_keys
        store._stored_keys = lambda starts, traces: lookups.append(len(traces)) or looked_up(starts, traces)
        for minute_part in range(12):  # 1,200 short spans over a minute: the horizon moves up
            at = BASE_NS + minute_part * (MINUTE_NS // 12)
            assert store.write(_json_batch(minute_part * 100, 100, at, at + 1000))
        assert store._keys.horizon > BASE_NS // BUCKET_NS + 1
        end = BASE_NS + MINUTE_NS
        long_span = _json_batch(9000, 1, start_ns=BASE_NS - 5 * MINUTE_NS, end_ns=end)
        assert store.write(long_span) and long_span.spans == 1 and lookups == []
        resent = _json_batch(9000, 1, start_ns=BASE_NS - 5 * MINUTE_NS, end_ns=end)
        store.write(resent)
        assert resent.spans == 0 and resent.duplicates == 1 and lookups == []
    finally:
        store.close()
    store = DuckDBStore(path)
    try:
        looked_up = store._stored_keys
        store._stored_keys = lambda starts, traces: lookups.append(len(traces)) or looked_up(starts, traces)
        assert store._keys._known(_json_batch(9000, 1, BASE_NS - 5 * MINUTE_NS, end).keys).all()
        again = _json_batch(9000, 1, start_ns=BASE_NS - 5 * MINUTE_NS, end_ns=end)
        store.write(again)
        assert again.spans == 0 and again.duplicates == 1 and lookups == []
        [(count,)] = store._con.execute("SELECT count(*) FROM spans WHERE span_id = ?", [f"{9001:016x}"]).fetchall()
        assert count == 1
    finally:
        store.close()


def test_a_hash_remembered_with_another_end_time_is_asked_of_the_store():
    """Two different spans with one 64-bit key hash cannot be made from real ids (the hash would have
    to be broken), so the second span's hash is set by hand: remembered with another end time, it is
    looked up in the store, and stored when the store does not hold it; with the same end time it is
    taken as the stored span."""
    keys, asked = SpanKeys(), []
    first = _json_batch(0, 1, BASE_NS, BASE_NS + 1000)
    keys.add_batch(first)
    other = _json_batch(7, 1, BASE_NS, BASE_NS + 5000)  # another span: other ids, another end time
    other.keys = first.keys.copy()

    def stored(starts, traces):
        asked.append(traces)
        return {(f"{1:032x}", f"{1:016x}")}  # the first span only

    assert keys.fresh(other, stored).all() and asked == [[f"{8:032x}"]]
    same_end = _json_batch(7, 1, BASE_NS - 7, BASE_NS + 1000 - 7)  # ends when the first did
    same_end.keys = first.keys.copy()
    assert not keys.fresh(same_end, stored).any() and len(asked) == 1
