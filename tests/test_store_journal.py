"""The DuckDB store's write-ahead journal (collector/stores/journal.py) and the packed layout's migration:
an acknowledged batch survives a process that dies before merging it, exactly once; a record cut
short by a crash is dropped and the rest appended; a store written by the previous layout
(migrations up to 008) opens with the same rows and the same cache answers; one written before 011
keeps its spans, their attributes then compressed with zstd; one written before 012 keeps its phases
without their span ids."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import duckdb
import golden
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from test_store_duckdb import _REACH_REFERENCE, _conversations

from tokentrace.collector.decoding.normalize import Batch, normalize
from tokentrace.collector.stores import sqlfiles
from tokentrace.collector.stores.store_duckdb import DuckDBStore

BASE = 1_790_000_000_000_000_000


def _golden_batch(offset_s: int = 0):
    body, _ = golden.encode(golden.load("golden_engine_trace.json"), BASE + offset_s * 1_000_000_000)
    return normalize(ExportTraceServiceRequest.FromString(body))


def _counts(path: Path) -> dict[str, int]:
    store = DuckDBStore(path, read_only=True)
    try:
        return store.counts()
    finally:
        store.close()


def _parsed_batch(offset_s: int = 0, body: bytes | None = None):
    """The golden trace as the collector's parse stage gives it: decoded, with the payload it came
    from (Columns.sources), which the journal then holds instead of the columns (``body``: that
    payload, to decode a body again as a resend)."""
    from tokentrace.collector.receiver.ingest import Counters, Pipeline
    from tokentrace.collector.receiver.otlp import PROTOBUF, Encoding

    if body is None:
        body, _ = golden.encode(golden.load("golden_engine_trace.json"), BASE + offset_s * 1_000_000_000)
    batch = Pipeline(Counters(), 1 << 24, 65_536).batch(body, Encoding("protobuf", PROTOBUF))
    assert batch.sources and batch.sources[0][0] == "protobuf"
    return batch


@pytest.mark.parametrize("made_by", ["_golden_batch", "_parsed_batch"], ids=["columns", "payload"])
def test_a_batch_journaled_and_never_merged_is_appended_at_the_next_open_once(tmp_path, made_by):
    """A child process journals three batches with its merge thread stopped, then dies (os._exit:
    no close, no merge). The next open appends them, once; opening again appends nothing more.
    Journaled as columns (a batch built in Python) or as the OTLP payload they were decoded from."""
    path = tmp_path / "s.duckdb"
    child = textwrap.dedent(f"""
        import os, sys, threading
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_store_journal import {made_by} as made
        from tokentrace.collector.stores.store_duckdb import DuckDBStore
        store = DuckDBStore({str(path)!r})
        store._journal._merge = lambda entries: threading.Event().wait()  # a merge that never ends
        for offset in (0, 10, 20):
            assert store.write(made(offset))
        print(store.journal_state()["unmerged_batches"] + (store._journal.merged == 0) * 100, flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("102", "103")  # 2 or 3 unmerged (the first may be in the stuck merge); none merged
    assert any((tmp_path / "s.duckdb.journal").glob("*.log"))
    one = sum(len(_golden_batch().expanded("spans")) for _ in range(1))
    assert _counts(path)["spans"] == 0  # read-only: the journal is not the tables'
    store = DuckDBStore(path)  # appends what the journal holds
    store.close()
    assert _counts(path)["spans"] == 3 * one
    assert not (tmp_path / "s.duckdb.journal").exists()  # merged and closed: no journal left
    DuckDBStore(path).close()
    assert _counts(path)["spans"] == 3 * one


def test_a_record_cut_short_is_dropped_and_the_records_before_it_kept(tmp_path, caplog):
    path = tmp_path / "s.duckdb"
    store = DuckDBStore(path)
    store._journal._merge = lambda entries: (_ for _ in ()).throw(OSError("disk gone"))  # nothing merges
    store.write(_golden_batch(0))
    store.write(_golden_batch(10))
    segment = next((tmp_path / "s.duckdb.journal").glob("*.log"))
    data = segment.read_bytes()
    store._journal._stopping = True  # leave the journal as a killed collector would
    store._con.close()
    segment.write_bytes(data + data[: len(data) // 3])  # a third record, torn by the crash
    reopened = DuckDBStore(path)
    reopened.close()
    assert "cut short" in caplog.text
    assert _counts(path)["spans"] == 2 * len(_golden_batch().expanded("spans"))


def test_a_merge_that_fails_keeps_the_batch_and_the_store_says_so(tmp_path):
    """A merge error leaves the batch in the journal and pending, /healthz's probe reports it, a
    reader stops waiting for it; once merges work again the batch is appended."""
    store = DuckDBStore(tmp_path / "s.duckdb")
    merge, failures = store._merge, []

    def failing(entries):
        if len(failures) < 2:
            failures.append(len(entries))
            raise OSError("no space left on device")
        merge(entries)

    store._journal._merge = failing
    store.write(_golden_batch())
    deadline = time.monotonic() + 30
    while store._journal.merged == 0 and time.monotonic() < deadline:
        store.settle()  # returns at once while merges fail, then waits for the retry to pass
    assert failures == [1, 1]
    assert store.counts()["spans"] == len(_golden_batch().expanded("spans"))
    store.probe()  # recovered: no error any more
    store.close()


def test_a_merge_that_failed_for_room_is_retried_once_the_disk_takes_a_write_again(tmp_path, monkeypatch):
    """A disk that fills: the merge of what was journaled fails and pauses, a write is refused for
    lack of room; once the disk takes a write again the failed merge is retried at once instead of
    after its pause (up to 5 s, here 600 s), so /healthz recovers with the first batch that passes.
    The disk's two states are injected: filling a real disk (tests/test_collector_network.py) cannot
    time a merge's failure."""
    from tokentrace.collector.stores import journal, store_duckdb
    from tokentrace.errors import StoreError

    monkeypatch.setattr(journal, "_RETRY_S", (600.0,))
    full = {"merge": False, "write": False}  # what the full disk fails: a merge, a write's check of its room
    real_free = store_duckdb.disk_free
    monkeypatch.setattr(store_duckdb, "disk_free", lambda path: 0 if full["write"] else real_free(path))
    store = DuckDBStore(tmp_path / "s.duckdb")
    merge = store._merge

    def merge_unless_full(entries):
        if full["merge"]:
            raise OSError("No space left on device")
        merge(entries)

    store._journal._merge = merge_unless_full
    try:
        full["merge"] = True  # between the journal's write and the merge's: the disk fills
        store.write(_golden_batch(0))
        full["write"] = True
        deadline = time.monotonic() + 30
        while store._journal.error is None:  # the merge has failed and begun its pause
            assert time.monotonic() < deadline, "the merge never ran"
            store._journal.settle(timeout=1)
        with pytest.raises(StoreError, match="bytes free"):
            store.write(_golden_batch(0))  # refused: the disk has no room
        full["merge"] = full["write"] = False
        assert store.write(_golden_batch(0)) is True  # the disk has room again
        deadline = time.monotonic() + 60  # a tenth of the pause
        while store._journal.error is not None:
            assert time.monotonic() < deadline, f"the failed merge waits out its pause: {store._journal.error}"
            store._journal.settle(timeout=1)
        store.settle()
        assert store.counts()["spans"] == 2 * len(_golden_batch(0).expanded("spans"))
        store.probe()
    finally:
        store.close()


def _migrated_to(path: Path, last: int) -> duckdb.DuckDBPyConnection:
    """A store file as an earlier version created it: the migrations up to ``last`` applied."""
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_migrations (version BIGINT PRIMARY KEY, name VARCHAR NOT NULL, "
                "applied_ns BIGINT NOT NULL)")
    for version, name, sql in sqlfiles.migrations("duckdb"):
        if version <= last:
            con.execute(sql)
            con.execute("INSERT INTO schema_migrations VALUES (?, ?, 0)", [version, name])
    return con


def _old_layout(path: Path, rows: list[tuple], decode: list[tuple]) -> None:
    """A store as the previous layout wrote it: migrations 001-008, expanded block and token rows,
    and prefix_sightings as its writer kept it (the first row of each hash, instance and source)."""
    con = _migrated_to(path, 8)
    for rid, instance, t_ns, source, fingerprint, hashes in rows:
        con.executemany("INSERT INTO prefix_blocks VALUES (?, ?, ?, ?, ?, ?, ?)",
                        [(rid, instance, t_ns, source, index, value, fingerprint)
                         for index, value in enumerate(hashes)])
    con.execute("""
        INSERT INTO prefix_sightings
        SELECT hash, arg_min(block_index, t_ns), min(t_ns), arg_min(request_id, t_ns), instance_id, source,
               arg_min(fingerprint, t_ns)
        FROM prefix_blocks GROUP BY hash, instance_id, source""")
    for rid, instance, start, offsets in decode:
        con.executemany("INSERT INTO decode_steps VALUES (?, ?, ?, ?)",
                        [(rid, instance, step, start + offset) for step, offset in enumerate(offsets)])
    con.close()


def test_a_store_of_the_previous_layout_opens_with_the_same_rows_and_cache_answers(tmp_path):
    path = tmp_path / "old.duckdb"
    rows = _conversations(seed=3, turns=150)
    decode = [(f"t{n}", f"i{n % 3}", BASE + n * 10**9, [0, 5_000_000, 12_000_000 + n]) for n in range(60)]
    decode.append(("t0", "i0", BASE + 999 * 10**9, [0, 7]))  # a request id used twice
    _old_layout(path, rows, decode)
    old = duckdb.connect(str(path))
    blocks = old.execute("SELECT * FROM prefix_blocks ORDER BY ALL").fetchall()
    steps = old.execute("SELECT * FROM decode_steps ORDER BY ALL").fetchall()
    old.close()
    store = DuckDBStore(path)  # migrates to the packed layout
    cursor = store._cursor()
    assert cursor.execute("SELECT * FROM prefix_blocks ORDER BY ALL").fetchall() == blocks
    assert cursor.execute("SELECT * FROM decode_steps ORDER BY ALL").fetchall() == steps
    compared = 0
    for rid, _, t_ns, source, _, hashes in rows:
        if source == "lookup":
            got = [tuple(row.values()) for row in store.rows("prefix_reach", hashes=hashes, before_ns=t_ns)]
            assert got == cursor.execute(_REACH_REFERENCE, {"before": t_ns, "prompt": hashes}).fetchall(), rid
            compared += bool(got)
    assert compared > 50
    # Written after the migration (and a restart: the memory of recent keys starts empty, so its
    # blocks count as new again): the answers for a later prompt still equal a scan of every block.
    late_t = rows[-1][2] + 10**9
    batch = Batch()
    batch.packed["prefix_blocks"].append(("late", rows[0][1], late_t, "lookup", None, rows[0][-1]))
    store.write(batch)
    prompt = rows[0][-1] + [7, 7]
    got = [tuple(row.values()) for row in store.rows("prefix_reach", hashes=prompt, before_ns=late_t + 1)]
    assert got == store._cursor().execute(_REACH_REFERENCE, {"before": late_t + 1, "prompt": prompt}).fetchall()
    store.close()


@pytest.mark.parametrize("layout", ["prefix_block_lists", "decode_step_lists"])
def test_the_packed_tables_are_what_the_old_names_expand(tmp_path, layout):
    store = DuckDBStore(tmp_path / "s.duckdb")
    store.write(_golden_batch())
    cursor = store._cursor()
    [(lists,)] = cursor.execute(f"SELECT count(*) FROM {layout}").fetchall()
    view = "prefix_blocks" if layout == "prefix_block_lists" else "decode_steps"
    [(expanded,)] = cursor.execute(f"SELECT count(*) FROM {view}").fetchall()
    assert 0 < lists < expanded
    store.close()


def _attributes_compression(path: Path) -> set[str]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        # Since 013 the table is span_rows (spans a view over it and the span files).
        [(table,)] = con.execute("SELECT table_name FROM duckdb_tables() WHERE table_name IN ('spans', 'span_rows')"
                                 ).fetchall()
        return {kind for (kind,) in con.execute(
            f"SELECT DISTINCT compression FROM pragma_storage_info('{table}') "
            "WHERE column_name = 'attributes' AND segment_type <> 'VALIDITY'").fetchall()}
    finally:
        con.close()


def test_a_store_written_before_011_keeps_every_span_and_compresses_their_attributes_with_zstd(tmp_path):
    """Migration 011 rebuilds spans with attributes USING COMPRESSION zstd (issue 17): rows kept,
    old and new ones compressed that way."""
    path = tmp_path / "old.duckdb"
    con = _migrated_to(path, 10)
    old_rows = _golden_batch().expanded("spans")
    con.executemany(f"INSERT INTO spans VALUES ({', '.join('?' * len(old_rows[0]))})", old_rows)
    con.execute("CHECKPOINT")
    spans = con.execute("SELECT * FROM spans ORDER BY ALL").fetchall()
    con.close()
    assert "ZSTD" not in _attributes_compression(path)  # what the previous layout chose
    store = DuckDBStore(path)
    assert store._cursor().execute("SELECT * FROM spans ORDER BY ALL").fetchall() == spans
    store.write(_golden_batch(offset_s=60))
    assert store.counts()["spans"] == 2 * len(spans)
    store.close()  # checkpoints
    assert _attributes_compression(path) == {"ZSTD"}
    fresh = tmp_path / "new.duckdb"
    store = DuckDBStore(fresh)
    store.write(_golden_batch())
    store.close()
    assert _attributes_compression(fresh) == {"ZSTD"}


def test_a_store_written_before_012_keeps_its_phases_without_their_span_ids(tmp_path):
    """Migration 012 drops the trace, span and parent span ids from phases (issue 17: `spans` holds
    them): every phase row is kept with its other columns, and the slowness verdict's phases query
    reads them and the rows written after alike."""
    path = tmp_path / "old.duckdb"
    con = _migrated_to(path, 11)
    phases = _golden_batch().expanded("phases")
    assert phases and len(phases[0]) == 9
    con.executemany("INSERT INTO phases VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [(r[0], r[1], f"t{n:031x}", f"s{n:015x}", None, *r[2:]) for n, r in enumerate(phases)])
    con.close()
    store = DuckDBStore(path)
    cursor = store._cursor()
    assert cursor.execute("SELECT * FROM phases ORDER BY ALL").fetchall() == sorted(phases)
    store.write(_golden_batch(offset_s=60))
    rid, start = phases[0][0], min(r[3] for r in phases if r[0] == phases[0][0])
    for offset in (0, 60 * 10**9):
        got = store.rows("phases", request_id=rid, t0_ns=start + offset, t1_ns=start + offset + 10**12)
        assert {row["name"] for row in got} == {r[2] for r in phases if r[0] == rid}
        assert "span_id" not in got[0]
    store.close()


def _journal(tmp_path: Path, merged: list, max_bytes: int = 1 << 30):
    from tokentrace.collector.stores import journal

    log_file = journal.Log(tmp_path / "j")
    merges = journal.Journal(lambda entries: merged.append([entry.seq for entry in entries]), log_file,
                             max_bytes=max_bytes)
    merges.start(after=0)
    return merges


def _entry(seq: int, nbytes: int = 100, on_released=None):
    from tokentrace.collector.stores import journal

    batch = _golden_batch().columns()
    return journal.Entry(seq, batch, nbytes, on_released=on_released), [b"record %d" % seq]


def test_a_merge_gathers_batches_until_a_reader_asks(tmp_path, monkeypatch):
    """Batches journaled one after another are merged together, not one merge each: the merge waits
    (here a gathering time longer than any wait of the test) until a reader needs them, and that
    reader's settle starts it at once. A patient reader (the /metrics verdict thread) does not."""
    from tokentrace.collector.stores import journal

    monkeypatch.setattr(journal, "GATHER_S", 3600.0)
    merged: list = []
    merges = _journal(tmp_path, merged)
    try:
        for seq in (1, 2, 3):
            merges.add(*_entry(seq))
        assert merges.settle(timeout=0.3, urgent=False) is False  # patient: nothing merged yet
        assert merged == []
        assert merges.settle(timeout=60) is True  # a reader: the three are merged now, together
        assert merged == [[1, 2, 3]]
    finally:
        merges.close()


def test_a_merge_starts_without_a_reader_once_its_batches_hold_a_third_of_the_bound(tmp_path, monkeypatch):
    import threading

    from tokentrace.collector.stores import journal

    monkeypatch.setattr(journal, "GATHER_S", 3600.0)
    merged: list = []
    stored = threading.Event()
    merges = _journal(tmp_path, merged, max_bytes=1000)
    try:
        merges.add(*_entry(1, nbytes=100))
        merges.add(*_entry(2, nbytes=250, on_released=stored.set))  # 350 bytes: past 1000 * GATHER_SHARE
        assert stored.wait(60)
        assert merged == [[1, 2]]
    finally:
        merges.close()


def test_a_store_opens_while_its_journaled_batches_cannot_be_appended_and_appends_them_later(tmp_path, monkeypatch):
    """A collector restarted on a full disk: the batches its journal holds cannot be appended yet.
    The open succeeds (it used to fail, and the collector with it), the store says why it is not
    healthy, a resend of those spans is still recognised, and once appending works again they are
    in the tables once."""
    from tokentrace.collector.stores import journal
    from tokentrace.errors import StoreError

    monkeypatch.setattr(journal, "_RETRY_S", (0.05,))
    path = tmp_path / "s.duckdb"
    store = DuckDBStore(path)
    store._journal._merge = lambda entries: (_ for _ in ()).throw(OSError("No space left on device"))
    batch = _golden_batch(0)  # its ids are new with every call
    store.write(batch)
    store._journal._stopping = True  # left as a killed collector leaves it
    store._con.close()

    failing = {"left": 3}
    real_merge = DuckDBStore._merge

    def merge(self, entries):
        if failing["left"]:
            failing["left"] -= 1
            raise OSError("No space left on device")
        real_merge(self, entries)

    monkeypatch.setattr(DuckDBStore, "_merge", merge)
    reopened = DuckDBStore(path)  # opens although its first merges fail
    try:
        with pytest.raises(StoreError, match="No space left"):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until the first failure is recorded
                reopened.probe()
                reopened._journal.settle(timeout=1)
        spans = len(batch.expanded("spans"))
        assert reopened.write(batch) is True and (batch.spans, batch.duplicates) == (0, spans)  # a resend
        reopened.settle()
        deadline = time.monotonic() + 60
        while reopened._journal.error is not None:  # the retries pass once the merge works again
            assert time.monotonic() < deadline, f"the merge still fails: {reopened._journal.error}"
            reopened._journal.settle(timeout=1)
        assert reopened.counts()["spans"] == spans  # once
        reopened.probe()
    finally:
        reopened.close()


def _pieces(record: bytes) -> list[tuple[str, bytes]]:
    """(kind, bytes) of each piece of a journal record (store_duckdb._record)."""
    from tokentrace.collector.stores.store_duckdb import _record_pieces

    return [(kind, bytes(piece)) for kind, _limit, piece in _record_pieces(memoryview(record))[1]]


def _span_ids(columns) -> list[tuple[str, str]]:
    spans = columns.tables["spans"]
    return sorted(zip(spans.column("trace_id").to_pylist(), spans.column("span_id").to_pylist(), strict=True))


def test_a_group_journals_the_payloads_of_its_parts_beside_a_resend_and_a_batch_built_in_python(tmp_path):
    """The writer groups batches of several senders into one write. The journal holds each part's
    OTLP payload where it has one: a resent batch (its spans left out as stored) or a batch built in
    Python in the same group used to make the whole group's rows be serialized as columns instead
    (issue 17, tenth round). Read back, the record gives the rows written, and the store appends
    each span once."""
    import threading

    from tokentrace.collector.decoding.columns import Columns
    from tokentrace.collector.stores import journal
    from tokentrace.collector.stores.store import as_columns
    from tokentrace.collector.stores.store_duckdb import _read_record

    path = tmp_path / "s.duckdb"
    store = DuckDBStore(path)
    real, release = store._journal._merge, threading.Event()
    store._journal._merge = lambda entries: (release.wait(60), real(entries))[1]  # held until read
    try:
        sent = _parsed_batch(0)
        assert store.write(sent)
        resent = _parsed_batch(body=sent.sources[0][2])  # the same payload again: its spans are stored
        parts = [_parsed_batch(10), resent, as_columns(_golden_batch(20)), _parsed_batch(30)]
        group = Columns.concat(parts)
        assert store.write(group)
        assert group.duplicates == resent.spans
        records = [bytes(data) for _, data in journal.Log(tmp_path / "s.duckdb.journal").records_after(0)]
    finally:
        release.set()
        store.close()
    assert [kind for kind, _ in _pieces(records[0])] == ["protobuf"]
    pieces = _pieces(records[1])
    assert [kind for kind, _ in pieces] == ["protobuf", "columns", "protobuf"]
    assert pieces[0][1] == parts[0].sources[0][2] and pieces[2][1] == parts[3].sources[0][2]
    replayed, _ = _read_record(memoryview(records[1]))
    assert _span_ids(replayed) == _span_ids(group)
    one = len(_golden_batch().expanded("spans"))
    assert _counts(path)["spans"] == 4 * one


def test_a_part_that_lost_some_spans_is_journaled_as_the_rows_it_kept():
    """A part of a group some of whose spans are left out has no payload that parses to its rows:
    those rows are journaled as columns, the other parts as their payloads, and the record reads
    back as the rows kept, in their order."""
    import numpy as np

    from tokentrace.collector.decoding.columns import Columns
    from tokentrace.collector.stores.store_duckdb import _read_record, _record

    first, second, third = _parsed_batch(0), _parsed_batch(10), _parsed_batch(20)
    group = Columns.concat([first, second, third])
    keep = np.ones(group.spans, dtype=bool)
    keep[first.spans:first.spans + second.spans:2] = False  # every other span of the second part
    kept = group.select(keep)
    assert [(kind, data is None, spans) for kind, _, data, spans in kept.sources] == [
        ("protobuf", False, first.spans), ("columns", True, second.spans // 2), ("protobuf", False, third.spans)]
    record = b"".join(_record(kept, None))
    assert [kind for kind, _ in _pieces(record)] == ["protobuf", "columns", "protobuf"]
    replayed, _ = _read_record(memoryview(record))
    assert replayed.spans == kept.spans
    for name, rows in kept.tables.items():
        assert replayed.tables[name].equals(rows), name
    assert [kind for kind, _ in _pieces(b"".join(_record(group.select(~keep), None)))] == ["columns"]


def _held_merge(store: DuckDBStore, monkeypatch):
    """Hold the store's merges up until the returned ``go`` is set, as DuckDB's checkpoint inside a
    merge's COMMIT does (3.5 s under engine-shaped load: issue 17, twentieth round; a checkpoint of
    that length cannot be made to happen at a chosen moment in a test); ``entered`` is set once a
    merge is held. A merge starts as soon as a batch is journaled and counts as held up at once."""
    import threading

    from tokentrace.collector.stores import journal

    monkeypatch.setattr(journal, "GATHER_S", 0.0)
    monkeypatch.setattr(journal, "PAUSE_S", 0.0, raising=False)  # the code before spills had none
    go, entered, merge = threading.Event(), threading.Event(), store._journal._merge

    def held(entries):
        entered.set()
        go.wait(120)
        merge(entries)

    store._journal._merge = held
    return go, entered


def _appended_once_let_go(store: DuckDBStore, go, one: dict[str, int], batches: int) -> None:
    """Let the held merge go on: every acknowledged batch is then in the tables, once."""
    go.set()
    store.settle()
    assert store.counts() == {name: batches * count for name, count in one.items()}


def _one_batch_counts(tmp_path: Path) -> dict[str, int]:
    """Rows per table that one golden batch makes."""
    reference = DuckDBStore(tmp_path / "one.duckdb")
    reference.write(_golden_batch())
    counts = reference.counts()
    reference.close()
    return counts


def test_batches_journaled_while_a_merge_is_held_up_are_spilled_to_disk_instead_of_refused(tmp_path, monkeypatch):
    """While a merge is held up (a DuckDB checkpoint), the batches journaled past the bytes the
    store may hold in memory are acknowledged all the same: their columns go to a spill file beside
    the journal and their bytes are released at once, where before the writes waited and were
    refused (503) once the bound was reached. When the merge goes on, every batch is in the tables
    once, read back from its file, and no file is left."""
    import threading

    from tokentrace.collector.stores import journal
    from tokentrace.collector.stores.store import as_columns

    monkeypatch.setattr(journal, "ROOM_TIMEOUT_S", 3.0)
    one = _one_batch_counts(tmp_path)
    store = DuckDBStore(tmp_path / "s.duckdb")
    go, entered = _held_merge(store, monkeypatch)
    store._journal.max_bytes = int(2.5 * as_columns(_golden_batch()).nbytes)  # two batches' columns
    released = [threading.Event() for _ in range(6)]
    try:
        for at, event in enumerate(released):
            assert store.write(_golden_batch(), None, event.set) is True
            if at == 0:
                assert entered.wait(60)  # the first batch's merge is held up
        folder = tmp_path / "s.duckdb.journal"
        assert [event.is_set() for event in released] == [False, False, True, True, True, True]
        assert len(list(folder.glob("*.spill"))) == 4
        state = store.journal_state()
        assert (state["spills"], state["unmerged_batches"]) == (4, 6)
        assert 0 < state["spilled_bytes"] < state["unmerged_bytes"]
        _appended_once_let_go(store, go, one, 6)
        assert all(event.wait(60) for event in released)
        assert not list(folder.glob("*.spill"))
        assert store.journal_state()["spilled_bytes"] == 0
    finally:
        go.set()
        store.close()


def test_a_batch_whose_spill_fails_stays_in_memory_and_the_bound_refuses_what_comes_after(tmp_path, monkeypatch):
    """A spill file that cannot be written (here a directory stands where it goes: the same OSError
    as a full disk): the batch is acknowledged, held in memory, and counts against the bound, so the
    next write is refused (Overloaded: 503 + Retry-After) instead of growing the collector."""
    from tokentrace.collector.stores import journal
    from tokentrace.collector.stores.store import as_columns
    from tokentrace.errors import Overloaded

    monkeypatch.setattr(journal, "ROOM_TIMEOUT_S", 0.2)
    one = _one_batch_counts(tmp_path)
    store = DuckDBStore(tmp_path / "s.duckdb")
    go, entered = _held_merge(store, monkeypatch)
    store._journal.max_bytes = int(1.5 * as_columns(_golden_batch()).nbytes)
    try:
        assert store.write(_golden_batch()) is True
        assert entered.wait(60)
        (tmp_path / "s.duckdb.journal" / f"{store._seq + 1:020d}.spill").mkdir()
        assert store.write(_golden_batch()) is True  # its spill failed: held in memory
        assert store.journal_state()["spills"] == 0
        with pytest.raises(Overloaded, match="retry later"):
            store.write(_golden_batch())
        _appended_once_let_go(store, go, one, 2)
    finally:
        go.set()
        store.close()


def test_spilled_bytes_have_a_bound_past_which_writes_are_refused(tmp_path, monkeypatch):
    """The disk a held-up merge's batches go to is bounded too: past ``max_spilled_bytes`` a write
    waits for the merge and is refused (Overloaded: 503 + Retry-After); what was acknowledged is
    appended once the merge goes on."""
    from tokentrace.collector.stores import journal
    from tokentrace.collector.stores.store import as_columns
    from tokentrace.errors import Overloaded

    monkeypatch.setattr(journal, "ROOM_TIMEOUT_S", 0.2)
    one = _one_batch_counts(tmp_path)
    store = DuckDBStore(tmp_path / "s.duckdb")
    go, entered = _held_merge(store, monkeypatch)
    size = as_columns(_golden_batch()).nbytes
    store._journal.max_bytes, store._journal.max_spilled_bytes = size // 2, int(1.5 * size)
    try:
        assert store.write(_golden_batch()) is True  # in memory: no merge was held up yet
        assert entered.wait(60)
        assert store.write(_golden_batch()) is True  # spilled
        assert store.write(_golden_batch()) is True  # spilled: now past the bound
        began = time.monotonic()
        with pytest.raises(Overloaded, match="retry later"):
            store.write(_golden_batch())
        assert time.monotonic() - began >= 0.2  # it waited for room first
        assert store.journal_state()["spills"] == 2
        _appended_once_let_go(store, go, one, 3)
    finally:
        go.set()
        store.close()


def test_spill_files_a_killed_collector_left_are_deleted_and_their_batches_appended_from_the_journal(tmp_path):
    """A collector killed while batches were spilled: the spill files are only copies of what the
    journal holds. The next open deletes them and appends every batch once, from the journal."""
    path = tmp_path / "s.duckdb"
    child = textwrap.dedent(f"""
        import os, sys, threading
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_store_journal import _golden_batch
        from tokentrace.collector.stores import journal
        from tokentrace.collector.stores.store import as_columns
        from tokentrace.collector.stores.store_duckdb import DuckDBStore
        journal.GATHER_S = journal.PAUSE_S = 0.0  # a merge starts at once and is held up at once
        store = DuckDBStore({str(path)!r})
        entered = threading.Event()
        store._journal._merge = lambda entries: entered.set() or threading.Event().wait()  # never ends
        store._journal.max_bytes = as_columns(_golden_batch()).nbytes // 2  # a batch is over it
        assert store.write(_golden_batch())  # held in memory, by the merge that never ends
        assert entered.wait(60)
        for _ in range(3):
            assert store.write(_golden_batch())  # spilled
        print(store.journal_state()["spills"], flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"
    folder = tmp_path / "s.duckdb.journal"
    assert len(list(folder.glob("*.spill"))) == 3
    one = _one_batch_counts(tmp_path)
    store = DuckDBStore(path)
    assert not list(folder.glob("*.spill"))
    store.close()
    assert _counts(path) == {name: 4 * count for name, count in one.items()}
    assert not folder.exists()
