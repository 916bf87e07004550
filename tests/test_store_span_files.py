"""Spans of large merges in Parquet files beside the DuckDB store (collector/stores/span_files.py, issue 17):
stored as the table stores them, listed in the transaction of their batches, compacted, and never
lost or doubled by a crash at any step. Batches are the golden engine trace (each call fresh ids);
``MIN_SPANS`` is lowered so that a merge of one batch makes a file."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import duckdb
import golden
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from test_store_damage import _damage
from test_store_journal import BASE, _counts, _golden_batch, _migrated_to, _parsed_batch

from tokentrace import contract as c
from tokentrace.analyzers.cache import _declared_limit_rank
from tokentrace.collector.decoding.normalize import normalize
from tokentrace.collector.stores import journal, span_files, store_check
from tokentrace.collector.stores.store_duckdb import DuckDBStore
from tokentrace.errors import StoreError

HERE = str(Path(__file__).parent)


@pytest.fixture
def files_for_every_merge(monkeypatch):
    monkeypatch.setattr(span_files, "MIN_SPANS", 1)
    monkeypatch.setattr(journal, "GATHER_S", 0.0)  # a merge a batch


def _spans(store: DuckDBStore) -> list[tuple]:
    return store._cursor().execute("SELECT * FROM spans ORDER BY ALL").fetchall()


def _files(path: Path) -> list[str]:
    folder = Path(str(path) + ".spans")
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _listed(store: DuckDBStore) -> list[str]:
    return sorted(name for (name,) in store._cursor().execute("SELECT name FROM span_files").fetchall())


def _checksums_hold(store: DuckDBStore) -> None:
    """Every listed file has the whole-file checksum listed for it (020_span_file_checksums.sql)."""
    rows = store._cursor().execute("SELECT name, crc32 FROM span_files").fetchall()
    assert rows and all(crc is not None for _, crc in rows), rows
    assert all(span_files.checksum(store._span_files.folder / name) == crc for name, crc in rows)


def _write_settled(store: DuckDBStore, offsets) -> None:
    for offset in offsets:
        assert store.write(_golden_batch(offset))
        store.settle()  # one merge each


def test_a_merge_with_enough_spans_stores_them_in_a_listed_file_as_the_table_would(tmp_path, monkeypatch):
    """The same batches into a store that keeps every span in its table and into one that writes a
    file a merge: the view `spans` gives the same rows, types and NULLs included, and the files on
    disk are exactly the ones listed, the table holding none of their rows."""
    strip = "SELECT * EXCLUDE (trace_id, span_id, parent_span_id) FROM spans ORDER BY ALL"
    table = DuckDBStore(tmp_path / "table.duckdb")
    _write_settled(table, (0, 10, 20))
    expected = _spans(table)
    expected_stripped = table._cursor().execute(strip).fetchall()
    table.close()
    monkeypatch.setattr(span_files, "MIN_SPANS", 1)
    store = DuckDBStore(tmp_path / "files.duckdb")
    _write_settled(store, (0, 10, 20))
    try:
        assert len(expected) > 0 and len(_spans(store)) == len(expected)
        # Ids differ between the two stores (each golden batch has fresh ones); everything else is equal.
        assert store._cursor().execute(strip).fetchall() == expected_stripped
        assert _listed(store) == _files(store.path) and len(_listed(store)) == 3
        [(in_table,)] = store._cursor().execute("SELECT count(*) FROM span_rows").fetchall()
        assert in_table == 0
        assert store.journal_state()["span_files"]["spans"] == len(expected)
        _checksums_hold(store)
    finally:
        store.close()
    assert _counts(tmp_path / "files.duckdb")["spans"] == len(expected)  # read-only, through the view


def test_a_merge_of_few_spans_appends_them_to_the_table_and_makes_no_file(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb")
    _write_settled(store, (0,))
    [(in_table,)] = store._cursor().execute("SELECT count(*) FROM span_rows").fetchall()
    assert in_table == store.counts()["spans"] > 0
    assert _files(tmp_path / "s.duckdb") == []
    store.close()


def test_spans_in_files_are_recognised_when_sent_again_after_a_restart(tmp_path, files_for_every_merge):
    """Exactly once reads the files: a resend after a restart (the writer's key memory loaded from
    the view) and a late span older than that memory (the store's lookup, span_keys.sql) are both
    dropped."""
    path = tmp_path / "s.duckdb"
    body, _ = golden.encode(golden.load("golden_engine_trace.json"), BASE)
    store = DuckDBStore(path)
    store.write(_parsed_batch(body=body))
    store.close()
    store = DuckDBStore(path)
    try:
        once = store.counts()["spans"]
        assert len(_listed(store)) == 1
        resend = _parsed_batch(body=body)
        store.write(resend)
        store.settle()
        assert store.counts()["spans"] == once
        assert resend.duplicates == once
        # The lookup the writer makes for spans its memory cannot rule out, over the files.
        rows = store._con.execute("SELECT trace_id, span_id, start_ns FROM spans").fetchall()
        found = store._stored_keys([r[2] for r in rows], sorted({r[0] for r in rows}))
        assert found == {(r[0], r[1]) for r in rows}
    finally:
        store.close()


def test_files_are_compacted_level_by_level_and_readers_see_every_span_once_meanwhile(tmp_path, monkeypatch,
                                                                                       files_for_every_merge):
    """Two files of a level make one of the next, up to the top level; the rows stay the same, a
    reader running throughout never sees a span twice or misses one (the replaced files outlive
    the swap by their grace: a read planned before it opens them), and closing deletes them."""
    monkeypatch.setattr(span_files, "FANOUT", 2)
    store = DuckDBStore(tmp_path / "s.duckdb")
    seen, stop = [], threading.Event()

    def read() -> None:
        cursor = store._thread_cursor()  # a reader thread's own cursor; no settle: what is committed
        while not stop.is_set():
            [(rows, distinct)] = cursor.execute("SELECT count(*), count(DISTINCT span_id) FROM spans").fetchall()
            seen.append((rows, distinct))

    reader = threading.Thread(target=read)
    try:
        _write_settled(store, (0,))
        per_batch = store.counts()["spans"]
        reader.start()
        _write_settled(store, (10, 20, 30))
        files = store._span_files
        with files.lock:  # 4 files of level 0 -> 2 of level 1 -> 1 of level 2
            assert files.lock.wait_for(lambda: files.compactions == 3, 120)
        stop.set()
        reader.join(60)
        assert [f.level for f in files.files] == [2]
        assert store.counts()["spans"] == 4 * per_batch
        assert len({span_id for (span_id,) in store._cursor().execute("SELECT span_id FROM spans").fetchall()}) \
            == 4 * per_batch
        assert all(rows == distinct and rows % per_batch == 0 for rows, distinct in seen)
        assert seen and seen[-1][0] == 4 * per_batch
        assert _listed(store) == [f.name for f in files.files]
        _checksums_hold(store)
        assert len(_files(tmp_path / "s.duckdb")) == 7  # the inputs of all three compactions, kept
    finally:
        stop.set()
        store.close()
    assert _files(tmp_path / "s.duckdb") == [files.files[0].name]
    assert _counts(tmp_path / "s.duckdb")["spans"] == 4 * per_batch


def test_the_inputs_of_a_compaction_are_deleted_once_their_grace_has_passed(tmp_path, monkeypatch,
                                                                            files_for_every_merge):
    monkeypatch.setattr(span_files, "FANOUT", 2)
    monkeypatch.setattr(span_files, "GRACE_S", 0.0)
    store = DuckDBStore(tmp_path / "s.duckdb")
    files = store._span_files
    try:
        _write_settled(store, (0, 10))
        with files.lock:
            assert files.lock.wait_for(lambda: files.compactions == 1 and not files._doomed, 120)
        assert _files(tmp_path / "s.duckdb") == _listed(store) == [files.files[0].name]
    finally:
        store.close()


def test_files_the_join_refuses_are_rewritten(tmp_path, monkeypatch, caplog, files_for_every_merge):
    """Span files written with a page index (absolute offsets a join by copying cannot move) are
    compacted by rewriting their rows; the spans stay the same."""
    monkeypatch.setattr(span_files, "FANOUT", 2)
    monkeypatch.setattr(span_files, "WRITE_OPTIONS", {**span_files.WRITE_OPTIONS, "write_page_index": True})
    store = DuckDBStore(tmp_path / "s.duckdb")
    files = store._span_files
    try:
        _write_settled(store, (0,))
        before = _spans(store)
        _write_settled(store, (10,))
        with files.lock:
            assert files.lock.wait_for(lambda: files.compactions == 1, 120)
        assert [f.level for f in files.files] == [1]
        assert "cannot be joined (a column chunk has a page index" in caplog.text
        after = _spans(store)
        assert len(after) == 2 * len(before) and set(before) < set(after)
        _checksums_hold(store)
    finally:
        store.close()


def test_a_compaction_refuses_an_input_damaged_since_the_open(tmp_path, monkeypatch, caplog, files_for_every_merge):
    """An input's footer statistics are copied into the joined file's footer: a flipped byte there
    (which no page checksum covers) would be vouched for by the joined file's checksum. The input
    is verified first, so the level is not compacted and the next open quarantines the file."""
    monkeypatch.setattr(span_files, "FANOUT", 2)
    path = tmp_path / "s.duckdb"
    store = DuckDBStore(path)
    files = store._span_files
    try:
        _write_settled(store, (0,))
        per_batch = store.counts()["spans"]
        [damaged] = _listed(store)
        _damage(files.folder / damaged, "flipped byte in the footer's statistics")
        _write_settled(store, (10,))
        deadline = time.monotonic() + 60
        while "is damaged (its checksum (CRC-32 0x" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"span file {damaged} is damaged (its checksum (CRC-32 0x" in caplog.text
        assert files.compactions == 0 and [f.level for f in files.files] == [0, 0]
    finally:
        store.close()
    store = DuckDBStore(path)
    try:
        [entry] = store.losses()
        assert entry["span_file"] == damaged and "differs from the one listed" in entry["why"]
        assert store.counts()["spans"] == per_batch and damaged not in _listed(store)
    finally:
        store.close()


def test_a_store_written_before_020_opens_and_its_files_are_still_page_checked(tmp_path, files_for_every_merge):
    """Files listed before 020_span_file_checksums.sql have no whole-file checksum (NULL): the store
    opens (read-only before the migration, too), their pages are checked as before, so a flipped byte
    in a data page is quarantined and one in the footer's statistics is not seen; files written
    after the migration have one."""
    path = tmp_path / "old.duckdb"
    store = DuckDBStore(path)
    _write_settled(store, (0, 10, 20))
    per_batch = store.counts()["spans"] // 3
    store.close()
    con = duckdb.connect(str(path))  # the store as 019 left it
    con.execute("ALTER TABLE span_files DROP COLUMN crc32")
    con.execute("DELETE FROM schema_migrations WHERE version = 20")
    con.close()
    assert _counts(path)["spans"] == 3 * per_batch  # read-only: not migrated, presence and size checked
    page, statistics, intact = sorted((Path(str(path) + ".spans")).iterdir())
    _damage(page, "flipped byte in a data page")
    _damage(statistics, "flipped byte in the footer's statistics")

    store = DuckDBStore(path)
    try:
        [entry] = store.losses()
        assert entry["kind"] == "damaged span file" and entry["span_file"] == page.name
        assert entry["why"].startswith("it does not read back: ") and "differs from the one listed" not in entry["why"]
        assert _listed(store) == [statistics.name, intact.name]
        assert store.counts()["spans"] == 2 * per_batch
        [(unsummed,)] = store._cursor().execute("SELECT count(*) FROM span_files WHERE crc32 IS NULL").fetchall()
        assert unsummed == 2
        _write_settled(store, (30,))
        [(name,)] = store._cursor().execute("SELECT name FROM span_files WHERE crc32 IS NOT NULL").fetchall()
        assert name not in (statistics.name, intact.name)
    finally:
        store.close()
    report = store_check.check(str(path))  # the gap these files keep: a flipped statistic is not seen
    assert report.clean and report.span_files == 3 and report.span_files_unsummed == 2
    assert "3 span files (2 listed before whole-file checksums: their pages checked)" in report.summary()


#: (what the golden insert declares as tokentrace.cache.limit_rank, what limit_rank holds): only a
#: non-negative integer is a rank; None leaves the attribute out.
_DECLARED = [(1, 1), (0, 0), (-1, None), (True, None), (1.0, None), ("1", None), (None, None)]


def _declaring(offset_s: int, declared):
    """The golden trace (fresh ids, ``offset_s`` later) with its insert declaring ``declared``."""
    fixture = golden.load("golden_engine_trace.json")
    attributes = next(s for s in fixture["spans"] if s["id"] == "insert")["attributes"]
    attributes.pop(c.CACHE_LIMIT_RANK)
    if declared is not None:
        attributes[c.CACHE_LIMIT_RANK] = declared
    body, _ = golden.encode(fixture, BASE + offset_s * 1_000_000_000)
    return normalize(ExportTraceServiceRequest.FromString(body))


@pytest.mark.parametrize("spans_in", ["span_rows", "span files"])
def test_a_store_written_before_021_gains_the_limit_rank_its_table_of_spans_declared(tmp_path, monkeypatch, spans_in):
    """021_insert_limit_rank.sql: cache_inserts gains limit_rank, and the rows stored before it take
    what their llm.cache.insert span declared, by the decoders' rule, where the span is in the table
    ``span_rows``; the spans of span files are not read there (the migration runs before the open
    checks them and points the view at where they are), so those rows stay undeclared. The cache
    verdict's read (``_declared_limit_rank``) then gives the rank or None."""
    if spans_in == "span files":
        monkeypatch.setattr(span_files, "MIN_SPANS", 1)
        monkeypatch.setattr(journal, "GATHER_S", 0.0)
    path = tmp_path / "old.duckdb"
    store = DuckDBStore(path)
    for n, (declared, _) in enumerate(_DECLARED):
        assert store.write(_declaring(10 * n, declared))
        store.settle()
    assert len(_listed(store)) == (len(_DECLARED) if spans_in == "span files" else 0)
    store.close()
    con = duckdb.connect(str(path))  # the store as 020 left it
    con.execute("ALTER TABLE cache_inserts DROP COLUMN limit_rank")
    con.execute("DELETE FROM schema_migrations WHERE version = 21")
    con.close()

    store = DuckDBStore(path)
    try:
        expected = [stored if spans_in == "span_rows" else None for _, stored in _DECLARED]
        got = store._cursor().execute("SELECT limit_rank FROM cache_inserts ORDER BY start_ns").fetchall()
        assert [rank for (rank,) in got] == expected
        for n, stored in enumerate(expected):  # the golden insert's eviction, 680.5 ms in
            eviction = {"evicted_by_request_id": "golden-req-1", "t_ns": BASE + (10 * n) * 10**9 + 680_500_000}
            assert _declared_limit_rank(store, "golden-1", eviction) == stored, n
            assert _declared_limit_rank(store, "golden-2", eviction) is None  # another instance's insert
        assert store.write(_declaring(100, 1))  # written after the migration: the decoders fill it
        store.settle()
        eviction = {"evicted_by_request_id": "golden-req-1", "t_ns": BASE + 100 * 10**9 + 680_500_000}
        assert _declared_limit_rank(store, "golden-1", eviction) == 1
    finally:
        store.close()


def _crash_child(path: Path, after: str) -> subprocess.CompletedProcess:
    """A child that writes golden batches into a store making a file a merge, and dies (os._exit)
    right after ``after``: "write" (the file written and synced, its transaction not begun) or
    "swap" (a compaction listed, its inputs not yet deleted)."""
    child = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {HERE!r})
        from test_store_journal import _golden_batch
        from tokentrace.collector.stores import journal, span_files, store_check
        from tokentrace.collector.stores.store_duckdb import DuckDBStore
        after = {after!r}
        span_files.MIN_SPANS, journal.GATHER_S = 1, 0.0
        span_files.FANOUT = 2 if after == "swap" else 1000  # "write": no compaction
        store = DuckDBStore({str(path)!r})
        for offset in (0, 10):
            assert store.write(_golden_batch(offset))
            store.settle()
        if after == "write":
            write = store._span_files.write
            def write_and_die(rows, name):
                write(rows, name)
                os._exit(0)
            store._span_files.write = write_and_die
            store.write(_golden_batch(20))
            store.settle()
        else:
            files = store._span_files  # its inputs' grace (60 s) outlives this child
            with files.lock:
                assert files.lock.wait_for(lambda: files.compactions == 1, 60)
                os._exit(0)
        os._exit(3)
    """)
    return subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)


def test_a_file_written_but_never_listed_is_deleted_at_the_next_open_and_its_batch_appended_once(
        tmp_path, files_for_every_merge):
    """A crash between a merge's file and its transaction: the file is not the store's (nothing
    lists it); the next open deletes it and the journal appends the batch again, once."""
    path = tmp_path / "s.duckdb"
    out = _crash_child(path, "write")
    assert out.returncode == 0, out.stderr
    assert len(_files(path)) == 3  # two listed, one written for the batch the crash cut off
    store = DuckDBStore(path)
    try:
        store.settle()
        per_batch = len(_golden_batch().expanded("spans"))
        assert store.counts()["spans"] == 3 * per_batch
        [(distinct,)] = store._cursor().execute("SELECT count(DISTINCT span_id) FROM spans").fetchall()
        assert distinct == 3 * per_batch
        assert _listed(store) == _files(path)
    finally:
        store.close()


def test_a_compaction_listed_before_a_crash_leaves_its_inputs_to_the_next_open(tmp_path):
    """A crash after a compaction's transaction, before its inputs' grace ended: the inputs are
    listed nowhere, so the next open deletes them; every span is read once, from the new file."""
    path = tmp_path / "s.duckdb"
    out = _crash_child(path, "swap")
    assert out.returncode == 0, out.stderr
    assert len(_files(path)) == 3  # the compacted file and its two inputs
    store = DuckDBStore(path, read_only=True)
    per_batch = len(_golden_batch().expanded("spans"))
    assert store.counts()["spans"] == 2 * per_batch  # a read-only open reads only the listed file
    store.close()
    store = DuckDBStore(path)
    try:
        assert _files(path) == _listed(store) and len(_listed(store)) == 1
        assert store.counts()["spans"] == 2 * per_batch
    finally:
        store.close()


def test_a_store_moved_with_its_folders_reads_its_files_where_they_are_now(tmp_path, files_for_every_merge):
    """The view names the files by their full path: a store moved (its file and folders) is read
    from its new place, read-only before any collector opened it there, and a collector's open
    points the view there for good."""
    old = tmp_path / "old"
    old.mkdir()
    store = DuckDBStore(old / "s.duckdb")
    _write_settled(store, (0, 10))
    spans = _spans(store)
    store.close()
    new = old.rename(tmp_path / "new")
    reader = DuckDBStore(new / "s.duckdb", read_only=True)
    assert _spans(reader) == spans
    assert reader.rows("trace", trace_id=spans[0][0])  # a named query, on a reader thread's cursor
    reader.close()
    DuckDBStore(new / "s.duckdb").close()
    reader = DuckDBStore(new / "s.duckdb", read_only=True)
    assert reader._search_path is None and _spans(reader) == spans
    reader.close()


def test_a_store_copied_without_its_span_files_says_so(tmp_path, files_for_every_merge):
    store = DuckDBStore(tmp_path / "s.duckdb")
    _write_settled(store, (0,))
    store.close()
    for path in (tmp_path / "s.duckdb.spans").iterdir():
        path.unlink()
    for read_only in (True, False):
        with pytest.raises(StoreError, match=r"1 of the 1 span files the store lists are missing"):
            DuckDBStore(tmp_path / "s.duckdb", read_only=read_only)


def test_a_store_written_before_013_keeps_its_spans_and_adds_files(tmp_path, files_for_every_merge):
    """Migration 013 renames the table to span_rows and reads it through the view: the rows written
    before stay, the files written after are read beside them."""
    path = tmp_path / "old.duckdb"
    con = _migrated_to(path, 12)
    old_rows = _golden_batch().expanded("spans")
    con.executemany(f"INSERT INTO spans VALUES ({', '.join('?' * len(old_rows[0]))})", old_rows)
    con.close()
    store = DuckDBStore(path)
    try:
        assert store.counts()["spans"] == len(old_rows)
        _write_settled(store, (60,))
        assert store.counts()["spans"] == 2 * len(old_rows)
        [(in_table,)] = store._cursor().execute("SELECT count(*) FROM span_rows").fetchall()
        assert in_table == len(old_rows) and len(_listed(store)) == 1
    finally:
        store.close()


def test_a_store_whose_path_is_a_pattern_keeps_its_spans_in_the_table(tmp_path, files_for_every_merge):
    """DuckDB reads a file name with * ? [ as a pattern: such a store makes no files."""
    folder = tmp_path / "a[1]"
    folder.mkdir()
    store = DuckDBStore(folder / "s.duckdb")
    _write_settled(store, (0,))
    try:
        assert store.counts()["spans"] > 0 and _files(folder / "s.duckdb") == []
    finally:
        store.close()
