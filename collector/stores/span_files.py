"""The spans of large merges, kept in Parquet files beside the DuckDB store (issue 17).

Why: a ``spans`` row is what every span costs the merge thread, and DuckDB's append of one cost
4.7-5.4 us of CPU an engine span (its rows converted, analysed, compressed and checkpointed),
where writing the same Arrow rows to a Parquet file costs 0.7 (zstd, no dictionary; 35 instead of
68 bytes a span on disk). In the collector under engine-shaped load that was 0.87 x the CPU a span
and 12 % more spans/s (docs/benchmarks.md, Issue 17, twenty-first round).

How: a merge of at least ``MIN_SPANS`` spans writes them to ``STORE.spans/NAME.parquet`` (synced,
name included) before its transaction, and the transaction that appends the batches' other rows
lists the file in ``span_files`` and redefines the view ``spans`` (``span_rows``, the rows of smaller
merges, and every listed file): a reader sees a file's spans exactly when it sees the rest of its
batches, and a failed transaction deletes its file. A file no transaction listed (a crash between
the two) is deleted at the next open; the journal appends its batches again.

Compaction: every merge adds a file, and each file costs a query that reads ``spans`` its footer
and a little planning (104 files of 100k spans: a trace read 22-45 ms against 4 in DuckDB's own
table). So a thread of its own, at a lower priority (``NICE``), joins ``FANOUT`` files of one level
into one file of the next as soon as a level has them, then swaps them in one transaction. Joining
copies the files' row groups byte for byte under one new footer (collector/stores/parquet_concat.py):
rewriting them (decoding and encoding every row group) cost 0.8-1.4 us of CPU a span a level, as
much as the files save the merge thread, and under sustained load it ran beside ingest (twenty-first
and twenty-second rounds). Files the join refuses (``Unjoinable``: none this module writes) are
rewritten, row group by row group. The replaced files are deleted ``GRACE_S`` later (a read
planned before the swap may still open them) or at close.

Checksums: each page carries the CRC-32 of its data (``WRITE_OPTIONS``), and ``span_files`` lists
the CRC-32 of the whole file (``crc32``, 020_span_file_checksums.sql), computed by one read of the
file once it is synced (``checksum``: 0.3 ms a MiB, against 100 to write and sync the file and 108
to check its pages at an open; 200k spans, 5.8 MiB, 2 cores at load 7) for a merge's file and a
compaction's, whose inputs are verified against theirs first (their footers' statistics are
copied into its footer). ``damaged`` verifies both, so a flipped byte anywhere in a file is
caught, a page header's or the footer's statistics included, which no page checksum covers.
Files listed before 020 have none (``crc32`` NULL): their pages are checked as before.

pyarrow is imported when a file is written: a read-only store (``tokentrace analyze --db``) reads
the files through DuckDB alone.

A store whose path holds a glob character (``*?[``) keeps every span in ``span_rows``: DuckDB would
read such a path as a pattern.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokentrace.collector.decoding.tables import TABLES
from tokentrace.collector.stores.parquet_concat import Unjoinable, join
from tokentrace.errors import StoreError
from tokentrace.threads import lower_priority, name_os_thread

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger("tokentrace.collector")

#: A merge with at least this many spans writes them to a file; a smaller one appends them to
#: ``span_rows`` (a collector taking a few requests a second never makes a file).
MIN_SPANS = 8_192
#: Files of one level compacted into one of the next.
FANOUT = 16
#: Files of this level are not compacted further (16^2 merges: 25M spans at 100k a merge).
TOP_LEVEL = 2
#: Seconds a compacted file's inputs outlive the swap (reads planned before it may open them).
GRACE_S = 60.0
#: How much lower the compaction thread's priority is than the collector's (nice).
NICE = 10
#: Rows per Parquet row group: what DuckDB's own tables had when span files were measured (their
#: Bloom filters are sized for it); DuckDB's tables now have 8,192 (store_duckdb.ROW_GROUP_SIZE).
ROW_GROUP_ROWS = 16_384
#: How a file is written: zstd, no dictionaries (a merge's ids and attribute objects seldom
#: repeat: 35 bytes a span, 0.7 us), and a Bloom filter of the trace ids in each row group, so that
#: one trace's read opens only the row groups that may hold it (40 files of 27k spans: 9 instead
#: of 38 ms; DuckDB's table, 7). Compaction writes the same.
#: Each page carries the CRC-32 of its bytes (``write_page_checksum``), which ``damaged`` verifies
#: when the store opens (DuckDB's reader does not); joining by copying keeps them.
WRITE_OPTIONS = {"compression": "zstd", "use_dictionary": False, "write_page_checksum": True,
                 "bloom_filter_options": {"trace_id": {"ndv": ROW_GROUP_ROWS, "fpp": 0.01}}}
#: A merge's file is named after its last journal sequence number, this many digits
#: (``000000000042.parquet``); a compacted one after its newest input's, with its level
#: (``000000000042.L1.parquet``).
SEQ_DIGITS = 12
#: What DuckDB reads as a pattern in a file name.
_GLOB = frozenset("*?[")
#: Bytes ``checksum`` reads at a time.
_CHUNK = 1 << 20
#: The columns of ``span_files`` and their types, in order (013_span_files.sql,
#: 020_span_file_checksums.sql): the fields of ``SpanFile``.
COLUMNS = (("name", "VARCHAR"), ("level", "INTEGER"), ("spans", "BIGINT"), ("min_start_ns", "BIGINT"),
           ("max_start_ns", "BIGINT"), ("bytes", "BIGINT"), ("written_ns", "BIGINT"), ("crc32", "BIGINT"))
#: Lists a file (``SpanFile.row()``).
INSERT = (f"INSERT INTO span_files ({', '.join(name for name, _ in COLUMNS)}) "
          f"VALUES ({', '.join('?' * len(COLUMNS))})")


@dataclass(frozen=True)
class SpanFile:
    """One listed file (a ``span_files`` row; ``COLUMNS``)."""

    name: str  #: the file's name in STORE.spans/
    level: int  #: 0: written by a merge; n: n-fold compacted
    spans: int  #: rows
    min_start_ns: int  #: when its earliest span started
    max_start_ns: int  #: when its latest span started
    bytes: int  #: its size when it was written
    written_ns: int  #: when it was written
    #: the CRC-32 of all its bytes when it was written (``checksum``); None: listed before
    #: 020_span_file_checksums.sql, only its pages' checksums are verified
    crc32: int | None = None

    def row(self) -> list:
        """The values of its ``span_files`` row, in ``COLUMNS`` order."""
        return [getattr(self, name) for name, _ in COLUMNS]


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SpanFiles:
    """The files of one store, the lock that orders every redefinition of the view, and the
    compaction thread (module docstring). ``swap(old, new, after)`` is the store's transaction that
    replaces the files ``old`` by ``new``, ``after`` being every file then; it runs with ``lock`` held."""

    def __init__(self, folder: Path, listed: list[SpanFile],
                 swap: Callable[[list[SpanFile], SpanFile, list[SpanFile]], None]):
        self.folder = folder
        self.files = list(listed)
        self.enabled = not (_GLOB & set(str(folder)))
        self.lock = threading.Condition()
        self.compactions = 0
        #: spans that started before this are past the store's retention (collector/stores/retention.py):
        #: the view hides them in the files that straddle it; None: no retention pass yet
        self.floor_ns: int | None = None
        self.expired = 0  #: files delisted by retention
        self._swap = swap
        self._doomed: list[tuple[float, list[Path]]] = []
        self._stopping = False
        self._compacting = False  #: ``start`` was called
        self._thread: threading.Thread | None = None

    # --- opening ----------------------------------------------------------------------------------
    def check(self) -> None:
        """StoreError when every listed file is missing (the store was copied without its folder);
        one missing among others is damage (``damaged``)."""
        missing = [f.name for f in self.files if not (self.folder / f.name).exists()]
        if missing and len(missing) == len(self.files):
            raise StoreError(f"{len(missing)} of the {len(self.files)} span files the store lists are missing from "
                             f"{self.folder} (first: {missing[0]}): a store is its file and the folders beside it")

    def damaged(self, full: bool = True, ranges: bool = False) -> list[tuple[SpanFile, str]]:
        """The listed files that do not read back, each with why (issue 45): missing, another size
        than when it was written, and, when ``full``, a whole-file checksum other than the one
        listed (files listed before 020 have none: their pages are checked as before), a footer that
        does not parse, another number of rows, or a page whose checksum fails or that does not
        decode (every page of every row group is read: 3.7 s for a file of 200k synthetic spans,
        29 MiB, on a 2-core machine at load 11, the whole-file checksum 0.3 ms a MiB more; real
        spans take 35 bytes, not 150, so a real file reads faster, but a store of many millions of
        spans makes the start take that long: issue 45 leaves this to a background check); with
        ``ranges`` too (``tokentrace store check|repair``), spans that started outside the time
        range listed for the file."""
        found = []
        for listed in self.files:
            path = self.folder / listed.name
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                found.append((listed, "the file is missing"))
                continue
            if size != listed.bytes:
                found.append((listed, f"the file has {size} bytes, {listed.bytes} when it was written (cut short "
                                      f"or overwritten)"))
            elif full:
                differs = _checksum_differs(path, listed)
                why = _unreadable(path, listed.spans, (listed.min_start_ns, listed.max_start_ns) if ranges else None)
                if differs is not None:  # what the pages say tells where the damage is
                    why = f"{differs}; {why}" if why is not None else \
                        f"{differs}; every page reads back with its own checksum (the damage is where none reaches: " \
                        f"a page header or the footer)"
                if why is not None:
                    found.append((listed, why))
        return found

    def clean(self) -> None:
        """Delete the files no transaction listed: a crash between writing and listing, or a
        compaction's inputs past their swap."""
        for path in self.unlisted():
            log.info("deleting %s: no transaction listed it (a collector stopped before)", path)
            path.unlink(missing_ok=True)

    def unlisted(self) -> list[Path]:
        """The files in the folder that no transaction listed (``clean`` deletes them)."""
        if not self.folder.is_dir():
            return []
        listed = {f.name for f in self.files}
        return sorted(path for path in self.folder.iterdir() if path.name not in listed)

    def literals(self, files: list[SpanFile] | None = None) -> list[str]:
        """The full paths of ``files`` (default: every listed one) as SQL string literals."""
        return ["'" + str(self.folder / f.name).replace("'", "''") + "'"
                for f in (self.files if files is None else files)]

    def view(self, files: list[SpanFile], prefix: str = "") -> str:
        """The SQL that defines ``spans`` over ``span_rows`` and ``files`` (``prefix``: the catalog)."""
        rows = f"SELECT * FROM {prefix}span_rows"
        if not files:
            return rows
        kept = "" if self.floor_ns is None else f" WHERE start_ns >= {int(self.floor_ns)}"
        return f"{rows} UNION ALL SELECT * FROM read_parquet([{', '.join(self.literals(files))}]){kept}"

    # --- the merge thread -------------------------------------------------------------------------
    def write(self, rows: pa.Table, name: str) -> SpanFile:
        """Write a merge's span rows to ``name`` (synced, and its name); not yet listed."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        if not self.folder.exists():
            self.folder.mkdir()
            _sync(self.folder.parent)  # the folder's own name is durable too
        path = self.folder / name
        try:
            pq.write_table(rows, str(path), row_group_size=ROW_GROUP_ROWS, **WRITE_OPTIONS)
            _sync(path)
            _sync(self.folder)
            crc32 = checksum(path)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        bounds = pc.min_max(rows.column("start_ns"))
        return SpanFile(name, 0, rows.num_rows, bounds["min"].as_py(), bounds["max"].as_py(),
                        path.stat().st_size, time.time_ns(), crc32)

    def discard(self, written: SpanFile) -> None:
        """A written file whose transaction failed."""
        with contextlib.suppress(OSError):
            (self.folder / written.name).unlink(missing_ok=True)

    def listed(self, written: SpanFile) -> None:
        """``written`` is listed (its transaction committed, ``lock`` held)."""
        self.files.append(written)
        self._start_thread()
        self.lock.notify_all()

    def expire(self, gone: list[SpanFile]) -> None:
        """``gone`` are delisted by a retention pass (its transaction committed, ``lock`` held):
        deleted ``GRACE_S`` from now, as a compaction's inputs are."""
        names = {f.name for f in gone}
        self.files = [f for f in self.files if f.name not in names]
        if gone:
            self.expired += len(gone)
            self._doomed.append((time.monotonic() + GRACE_S, [self.folder / f.name for f in gone]))
            self._start_thread()
            self.lock.notify_all()

    # --- compaction -------------------------------------------------------------------------------
    def start(self) -> None:
        """Compact from now on: the thread starts with the first file (a collector whose merges
        make none has no such thread)."""
        self._compacting = True
        if self.files:
            self._start_thread()

    def _start_thread(self) -> None:
        if self._compacting and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tokentrace-compact", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop compacting (a compaction under way is given up) and delete the replaced files."""
        with self.lock:
            self._stopping, self._compacting = True, False
            self.lock.notify_all()
        if self._thread is not None:
            self._thread.join()
        for _, paths in self._doomed:
            for path in paths:
                path.unlink(missing_ok=True)
        self._doomed.clear()

    def snapshot(self) -> dict:
        """A JSON-ready view for /healthz."""
        with self.lock:
            levels: dict[str, int] = {}
            for f in self.files:
                levels[str(f.level)] = levels.get(str(f.level), 0) + 1
            return {"files": len(self.files), "spans": sum(f.spans for f in self.files),
                    "bytes": sum(f.bytes for f in self.files), "files_by_level": levels,
                    "compactions": self.compactions, "expired": self.expired}

    def _group(self) -> list[SpanFile] | None:
        """The oldest ``FANOUT`` files of the lowest level that has that many (else None); ``lock`` held."""
        for level in range(TOP_LEVEL):
            same = [f for f in self.files if f.level == level]
            if len(same) >= FANOUT:
                return same[:FANOUT]
        return None

    def _run(self) -> None:
        name_os_thread()
        lower_priority(NICE)
        while True:
            with self.lock:
                while not self._stopping:
                    group = self._group()
                    if group is not None:
                        break
                    self.lock.wait(self._doomed[0][0] - time.monotonic() if self._doomed else None)
                    self._delete_due()
                if self._stopping:
                    return
            try:
                merged = self._compact(group)
            except Exception:
                log.exception("compacting %d span files failed; retrying in %.0f s", len(group), GRACE_S)
                with self.lock:
                    self.lock.wait_for(lambda: self._stopping, GRACE_S)
                continue
            if merged is None:  # stopping
                return
            try:
                with self.lock:
                    names = {f.name for f in group}
                    at = min(i for i, f in enumerate(self.files) if f.name in names)
                    after = [f for f in self.files if f.name not in names]
                    after.insert(at, merged)
                    self._swap(group, merged, after)
                    self.files = after
                    self.compactions += 1
                    self._doomed.append((time.monotonic() + GRACE_S, [self.folder / f.name for f in group]))
                    self.lock.notify_all()
            except Exception:
                log.exception("listing the compacted span file %s failed; its inputs stay", merged.name)
                (self.folder / merged.name).unlink(missing_ok=True)
                with self.lock:
                    self.lock.wait_for(lambda: self._stopping, GRACE_S)

    def _delete_due(self) -> None:
        """Delete the replaced files whose grace has passed (``lock`` held)."""
        now = time.monotonic()
        while self._doomed and self._doomed[0][0] <= now:
            for path in self._doomed.pop(0)[1]:
                try:
                    path.unlink(missing_ok=True)
                except OSError:  # left for the next open's clean
                    log.exception("deleting the compacted span file %s failed", path)
            self.lock.notify_all()

    def _compact(self, group: list[SpanFile]) -> SpanFile | None:
        """``group`` joined (else rewritten) into one file of the next level (None: stopping)."""
        level = group[0].level + 1
        name = f"{group[-1].name[:SEQ_DIGITS]}.L{level}.parquet"
        path = self.folder / name
        inputs = [self.folder / f.name for f in group]
        for listed, source in zip(group, inputs, strict=True):
            # Their footers' statistics are copied into the new footer: a checksum computed over them
            # would vouch for damage no page checksum catches.
            why = _checksum_differs(source, listed)
            if why is not None:
                raise StoreError(f"span file {listed.name} is damaged ({why}): its level is not compacted until "
                                 f"the next open quarantines it")
        try:
            done = join(inputs, path, lambda: self._stopping)
        except Unjoinable as exc:
            log.warning("span files %s..%s cannot be joined (%s): rewriting them", group[0].name, group[-1].name, exc)
            done = rewrite(inputs, path, lambda: self._stopping)
        if not done:
            return None
        try:
            _sync(path)
            _sync(self.folder)
            crc32 = checksum(path)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return SpanFile(name, level, sum(f.spans for f in group), min(f.min_start_ns for f in group),
                        max(f.max_start_ns for f in group), path.stat().st_size, time.time_ns(), crc32)


def checksum(path: Path) -> int:
    """The CRC-32 (zlib's) of every byte of the file at ``path``, in one read: 0.3 ms a MiB
    (0.25-1.7) of a file just synced (still in the page cache), on a 2-core machine at load 7."""
    crc = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(buffer):
            crc = zlib.crc32(view[:count], crc)
    return crc


def _checksum_differs(path: Path, listed: SpanFile) -> str | None:
    """Why the file at ``path`` is not the file ``listed`` by its whole-file checksum, or None (also
    for a file listed before 020_span_file_checksums.sql, which has none)."""
    if listed.crc32 is None:
        return None
    try:
        found = checksum(path)
    except OSError as exc:
        return f"it does not read back: {type(exc).__name__}: {exc}"
    if found == listed.crc32:
        return None
    return (f"its checksum (CRC-32 {found:#010x}) differs from the one listed when it was written "
            f"({listed.crc32:#010x})")


def _unreadable(path: Path, spans: int, bounds: tuple[int, int] | None = None) -> str | None:
    """Why the Parquet file at ``path`` (listed with ``spans`` rows and, when given, spans that
    started within ``bounds``, ns) does not read back, or None."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    low = high = None
    try:
        source = pq.ParquetFile(path, page_checksum_verification=True)
        if source.metadata.num_rows != spans:
            return f"its footer says {source.metadata.num_rows} rows, {spans} were written"
        if source.schema_arrow.names != list(TABLES["spans"]):
            return f"its footer names the columns {source.schema_arrow.names}, not the spans table's"
        for index in range(source.num_row_groups):
            rows = source.read_row_group(index)  # every page: decompressed, decoded, its checksum verified
            if bounds is not None and rows.num_rows:
                found = pc.min_max(rows.column("start_ns"))
                first, last = found["min"].as_py(), found["max"].as_py()
                if first is not None:
                    low, high = (first, last) if low is None else (min(low, first), max(high, last))
    except Exception as exc:  # whatever pyarrow says of a damaged file is the reason
        return f"it does not read back: {type(exc).__name__}: {exc}"
    if bounds is not None and low is not None and (low < bounds[0] or high > bounds[1]):
        return f"its spans started from {low} to {high} ns, the store lists {bounds[0]} to {bounds[1]}"
    return None


def rewrite(inputs: list[Path], output: Path, stopping: Callable[[], bool]) -> bool:
    """``output``: the rows of ``inputs`` read and written again, row group by row group (memory
    stays a row group's), as a merge writes them. False (and no output) once ``stopping()``."""
    import pyarrow.parquet as pq

    writer = None
    try:
        for path in inputs:
            source = pq.ParquetFile(path)
            for index in range(source.num_row_groups):
                if stopping():
                    raise _Stopping
                rows = source.read_row_group(index)
                if writer is None:
                    writer = pq.ParquetWriter(str(output), rows.schema, **WRITE_OPTIONS)
                writer.write_table(rows, row_group_size=ROW_GROUP_ROWS)
        writer.close()
    except BaseException as exc:
        if writer is not None:
            writer.close()
        output.unlink(missing_ok=True)
        if isinstance(exc, _Stopping):
            return False
        raise
    return True


class _Stopping(Exception):
    """A compaction given up: the store is closing."""
