"""The embedded DuckDB store: one file (its journal and span files in folders beside it), numbered
migrations, Arrow appends, per-thread readers.

DuckDB lets one process open a file for writing; other processes can open it read-only only while
no writer holds it. So ``tokentrace analyze --db`` works on a stopped collector's file, and
``--url`` asks the running collector.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

try:
    # DuckDB's engine without its Python package around it (a relational API, expression builders,
    # hooks for Python objects as tables, a version lookup through importlib.metadata): what a
    # read-only verdict uses (connect, execute, fetchall, the exceptions) is the engine's, and the
    # package's objects are these same ones. `python -c "import _duckdb"` takes 60 ms, with
    # "import duckdb" 180 (measured); 45 ms less for `tokentrace analyze --db` (A/B in one run,
    # docs/benchmarks.md). The writer and frames import the package as well
    # (``_libraries``): registering Arrow tables needs its hooks.
    import _duckdb as duckdb
except ImportError:  # a DuckDB whose engine module is not top-level (1.x: duckdb.duckdb)
    import duckdb

from tokentrace.collector.decoding.tables import PACKED, PACKED_TYPES, TABLES, TYPES
from tokentrace.collector.stores import retention, sqlfiles
from tokentrace.collector.stores.quarantine import Quarantine
from tokentrace.collector.stores.store import NamedQueryReader, SpoolRecord, T, as_columns, write_failure
from tokentrace.errors import NotFound, Overloaded, PayloadError, StoreError
from tokentrace.threads import name_os_thread

if TYPE_CHECKING:
    from tokentrace.collector.decoding.normalize import Batch
    from tokentrace.collector.stores.journal import Entry, Journal, Log

log = logging.getLogger("tokentrace.collector")

#: numpy, polars, pyarrow and the writer's modules, bound by ``_libraries()`` for the writer and for
#: frames: a read-only store answering ``rows()`` (``tokentrace analyze --db``) imports none of them
#: (issue 17).
np = pl = pa = pc = once = frontier = journal = span_files = Columns = None


def _libraries() -> None:
    global np, pl, pa, pc, once, frontier, journal, span_files, Columns
    if once is None:
        import duckdb as package  # noqa: F401  (its hooks for Arrow tables and Python objects)
        import numpy
        import polars
        import pyarrow
        import pyarrow.compute

        from tokentrace.collector.decoding import columns
        from tokentrace.collector.stores import frontier as fresh
        from tokentrace.collector.stores import journal as log_ahead
        from tokentrace.collector.stores import once as exactly_once
        from tokentrace.collector.stores import span_files as parquet_spans

        np, pl, pa, pc, frontier, journal = numpy, polars, pyarrow, pyarrow.compute, fresh, log_ahead
        Columns, once, span_files = columns.Columns, exactly_once, parquet_spans


CHECKPOINT_THRESHOLD = "256MB"
#: Rows per row group of the tables a store writes (DuckDB's default: 122,880). DuckDB writes a
#: transaction's rows of a table straight to the file, compressed, when it gives the table at least
#: this many rows; fewer go to its WAL, held in memory uncompressed until a checkpoint compresses
#: them (in the collector at 16,384: a checkpoint of 1.8-2.6 s of the merge thread's CPU every
#: ~1.8M engine spans; the COMMITs, these included, 2.1 of the thread's 6 us a span). A loaded
#: collector's merge (70-90k engine spans, their spans in a span file) gives ``requests``,
#: ``decode_step_lists``, ``cache_lookups`` and ``cache_inserts`` ~10k rows each: under 16,384,
#: over 8,192. At 8,192 (issue 17, twenty-third round, bench/ab.py, 130-s runs):
#: 0.916 x the collector's CPU a span, 107k -> 121k spans/s acknowledged, peak memory 2,071 ->
#: 1,751 MiB; a store of 1.14M requests written by the collector 324 instead of 343 bytes a span;
#: bench/analyze.py at 1.25M requests met every verdict target (slow p99 20 ms, cache 31).
#: Earlier, with the spans in DuckDB's table, merge CPU a span over 2.76M spans: 9.8-11.1 us at
#: 122,880 rows, 10.7 at 65,536, 7.9-8.7 at 32,768, 6.4-6.8 at 16,384; verdicts read fewer rows
#: (finer min/max pruning): at 200k requests, slow p99 13.7 against 20.2 ms at 122,880, 15.7 at
#: 8,192 (docs/benchmarks.md, Issue 17, sixth round).
#: DuckDB takes it per attach, not from the file: a store written before keeps its row groups, and
#: what is added to it gets the new size.
ROW_GROUP_SIZE = 8_192
#: The alias of the store's file in its DuckDB instance (``_attach``).
_ALIAS = "store"
#: Free bytes below which /healthz says the store is not writable: the WAL of one group of writes
#: needs about this much, and a checkpoint more.
MIN_FREE_BYTES = 1 << 20
#: Threads for ``together``: a cache verdict runs three branches at once.
READER_THREADS = 4


def _attach(path: str, read_only: bool) -> duckdb.DuckDBPyConnection:
    """A DuckDB instance with the store's file attached and in use: a file opened by
    ``duckdb.connect`` takes no storage options, and ``ROW_GROUP_SIZE`` is one. DuckDB's spill files
    go where they went for a connected file (``FILE.tmp``), not to the working directory."""
    con = duckdb.connect()
    quoted = path.replace("'", "''")
    options = "READ_ONLY" if read_only else f"ROW_GROUP_SIZE {ROW_GROUP_SIZE}"
    try:
        con.execute(f"ATTACH '{quoted}' AS {_ALIAS} ({options})")
        con.execute(f"USE {_ALIAS}")
        con.execute(f"SET temp_directory = '{quoted}.tmp'")
        # Span files (collector/stores/span_files.py) never change once listed: their footers are read once.
        con.execute("SET GLOBAL parquet_metadata_cache = true")
    except BaseException:
        con.close()
        raise
    return con


@contextlib.contextmanager
def _transaction(cursor: duckdb.DuckDBPyConnection) -> Iterator[None]:
    """BEGIN, then COMMIT if the block ends, else ROLLBACK (its own failure not masking the block's)."""
    try:
        cursor.execute("BEGIN")
        yield
        cursor.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(duckdb.Error):
            cursor.execute("ROLLBACK")
        raise


def _cursor_of(con: duckdb.DuckDBPyConnection, search_path: str | None = None) -> duckdb.DuckDBPyConnection:
    """A cursor of ``con`` that reads and writes the store's file (``USE`` and the search path are
    per cursor)."""
    cursor = con.cursor()
    cursor.execute(f"USE {_ALIAS}")
    if search_path is not None:
        cursor.execute(f"SET search_path = '{search_path}'")
    return cursor


def disk_free(path: str) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of ``path`` (None: unknown)."""
    try:
        stat = os.statvfs(_directory(path))
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


@lru_cache(maxsize=64)
def _directory(path: str) -> Path:
    """The directory of the file ``path`` names, links followed: found once per path, not for every
    write (``Path.resolve``, an lstat per part of the path, was 6 % of the writer thread under load;
    py-spy, docs/benchmarks.md, Issue 17, tenth round)."""
    return Path(path).resolve().parent


def _polars_type(duckdb_type: str) -> pl.DataType | None:
    """The polars dtype of a DuckDB result type; None for types left to polars' inference."""
    if duckdb_type.endswith("[]"):
        inner = _polars_type(duckdb_type[:-2])
        return None if inner is None else pl.List(inner)
    return {"VARCHAR": pl.String, "BIGINT": pl.Int64, "INTEGER": pl.Int32, "DOUBLE": pl.Float64, "BOOLEAN": pl.Boolean,
            "HUGEINT": pl.Int128, "UBIGINT": pl.UInt64, "FLOAT": pl.Float32}.get(duckdb_type)


#: Where each packed table's rows are stored (009_packed_lists.sql; the names in TABLES are views
#: that expand them), and the columns stored beyond the packed form.
LISTS: dict[str, str] = {"decode_steps": "decode_step_lists", "prefix_blocks": "prefix_block_lists"}
#: Where the spans of merges too small for a file of their own are stored (013_span_files.sql; the
#: view ``spans`` reads them and the span files).
SPAN_ROWS = "span_rows"
LIST_EXTRA: dict[str, tuple[tuple[str, str], ...]] = {
    "decode_steps": (), "prefix_blocks": (("fresh_from", "INTEGER"), ("fresh_hash", "BIGINT")),
}


_LIST_PARAM = re.compile(r"\$([a-z_][a-z0-9_]*)\[\]")


def bind_lists(sql: str, params: dict) -> tuple[str, dict]:
    """Expand each ``$name[]`` of a named query into one bound parameter per element of the list
    ``params[name]`` (``NULL`` for an empty list): DuckDB's planner uses an ART index for an IN list
    of values, and scans the table for ``= ANY($list)``. A plain ``$name`` of the same list in the
    same query stays bound to the whole list."""
    lists = {match.group(1) for match in _LIST_PARAM.finditer(sql)}
    if not lists:
        return sql, params
    bound = {name: value for name, value in params.items() if name not in lists}
    for name in lists:
        for index, value in enumerate(params[name]):
            bound[f"{name}_{index}"] = value

    def expand(match: re.Match) -> str:
        name = match.group(1)
        return ", ".join(f"${name}_{index}" for index in range(len(params[name]))) or "NULL"

    sql = _LIST_PARAM.sub(expand, sql)
    for name in lists:
        if re.search(rf"\${name}\b", sql):
            bound[name] = params[name]
    return sql, bound


def _call(callback: Callable[[], None] | None) -> None:
    if callback is not None:
        callback()


def _record(columns: Columns, spool: SpoolRecord | None) -> list[bytes]:
    """A journal record, in pieces: the spool file it came from (if any) and what each part of the
    batch was parsed from (Columns.journal_pieces: its OTLP payloads, and its other rows as bytes)."""
    parts = columns.journal_pieces()
    head = json.dumps({"spool": None if spool is None else [spool.sha256, spool.name],
                       "parts": [[kind, limit, len(data)] for kind, limit, data in parts]}).encode()
    return [struct.pack("<I", len(head)), head, *(data for _, _, data in parts)]


def _read_record(data: memoryview) -> tuple[Columns, SpoolRecord | None]:
    """The batch a journal record holds (``_record``), with each span's key hash, and its spool file;
    PayloadTooLarge for one whose columns would pass what the store may hold unmerged in memory
    (collector/receiver/ingest.py: a batch a collector before issue 45 took, that wedged its merge)."""
    from tokentrace.collector.receiver.ingest import parse  # a journal left by a stopped collector: rare
    from tokentrace.collector.receiver.otlp import JSON, PROTOBUF, Encoding

    spool, pieces = _record_pieces(data)
    parts = []
    for kind, limit, piece in pieces:
        if kind == "columns":
            parts.append(Columns.from_bytes(piece))
        else:
            encoding = Encoding(kind, PROTOBUF if kind == "protobuf" else JSON)
            parts.append(parse(bytes(piece), encoding, None, len(piece), limit,
                               max_columns=journal.MAX_UNMERGED_BYTES))
    columns = Columns.concat(parts)
    if columns.spans and len(columns.keys) != columns.spans:  # a part journaled as columns has no keys
        spans = columns.tables["spans"]
        columns.keys = once.key_hashes(spans.column("trace_id").to_pylist(), spans.column("span_id").to_pylist())
    return columns, None if spool is None else SpoolRecord(*spool)


def _record_pieces(data: memoryview) -> tuple[list | None, list[tuple[str, int, memoryview]]]:
    """The spool file named in a journal record (``_record``) and its pieces: (kind,
    max_value_length, bytes)."""
    (size,) = struct.unpack_from("<I", data)
    head = json.loads(bytes(data[4:4 + size]))
    pieces, at = [], 4 + size
    for kind, limit, length in head["parts"]:
        pieces.append((kind, limit, data[at:at + length]))
        at += length
    return head["spool"], pieces


def _utc(ns: int | None) -> str | None:
    """A time in ns since the epoch as ISO 8601 UTC (None stays None: unknown)."""
    if ns is None:
        return None
    import datetime

    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.UTC).isoformat(timespec="milliseconds")


def _keys_in(entries: list[Entry], traces: list[str]) -> set[tuple[str, str]]:
    """The (trace id, span id) of the spans of ``entries`` in the traces ``traces``."""
    found: set[tuple[str, str]] = set()
    wanted = pa.array(traces, pa.string())
    for entry in entries:
        spans = entry.load().tables.get("spans")
        if spans is not None:
            hit = spans.filter(pc.is_in(spans.column("trace_id"), value_set=wanted))
            found.update(zip(hit.column("trace_id").to_pylist(), hit.column("span_id").to_pylist(), strict=True))
    return found


def check_columns(con: duckdb.DuckDBPyConnection, path: str) -> None:
    """StoreError unless every table of the store ``con`` has attached has this version's columns
    and types (TABLES, TYPES; the packed tables' lists and ``span_files`` too). One catalog query
    (1.4 ms; one information_schema query per table took 36 ms of every CLI verdict). A store
    written before 020_span_file_checksums.sql, opened read-only (no migration applied), lists its
    span files without ``crc32``: its open checks their presence and size only, which needs none."""
    from tokentrace.collector.stores.span_files import COLUMNS as SPAN_FILE_COLUMNS

    listed: dict[str, list[tuple[str, str]]] = {}
    for table, name, kind in con.execute(
        "SELECT table_name, column_name, data_type FROM duckdb_columns() "
        "WHERE database_name = current_database() AND schema_name = 'main' ORDER BY table_name, column_index"
    ).fetchall():
        listed.setdefault(table, []).append((name, kind))
    expected = {table: list(zip(columns, TYPES[table], strict=True)) for table, columns in TABLES.items()}
    expected[SPAN_ROWS] = expected["spans"]
    for table, stored in LISTS.items():
        expected[stored] = [*zip(PACKED[table], PACKED_TYPES[table], strict=True), *LIST_EXTRA[table]]
    expected["span_files"] = list(SPAN_FILE_COLUMNS)
    for table, columns in expected.items():
        if table == "span_files" and listed.get(table) == columns[:-1]:  # before 020: no crc32
            continue
        if listed.get(table, []) != columns:
            raise StoreError(f"table {table} of {path} has columns {listed.get(table, [])}, "
                             f"expected {columns}: the file comes from another version")


def listed_span_files(con: duckdb.DuckDBPyConnection) -> list:
    """The span files the store lists (``span_files``, collector/stores/span_files.py), oldest first;
    without checksums (``crc32`` None) in a store written before 020_span_file_checksums.sql opened
    read-only."""
    from tokentrace.collector.stores import span_files as parquet_spans  # no pyarrow: a read-only open needs none

    names = [name for name, _ in parquet_spans.COLUMNS]
    try:
        rows = con.execute(f"SELECT {', '.join(names)} FROM span_files ORDER BY written_ns, name").fetchall()
    except duckdb.BinderException:  # no crc32 column: a store before 020, not migrated (read-only)
        rows = con.execute(f"SELECT {', '.join(names[:-1])}, NULL FROM span_files "
                           f"ORDER BY written_ns, name").fetchall()
    return [parquet_spans.SpanFile(*row) for row in rows]


_QUOTED = re.compile(r"'((?:[^']|'')*)'")


def spans_view_paths(con: duckdb.DuckDBPyConnection) -> set[str]:
    """The paths of the span files the view ``spans`` reads (its definition's string literals)."""
    [(defined,)] = con.execute(
        "SELECT sql FROM duckdb_views() WHERE database_name = current_database() AND view_name = 'spans'"
    ).fetchall()
    return {literal.replace("''", "'") for literal in _QUOTED.findall(defined)}


def retention_of(con: duckdb.DuckDBPyConnection) -> tuple[int, int | None]:
    """The retention a store keeps (seconds, 0: everything) and the floor of its last pass (None:
    none yet); (0, None) for a store written before retention (019_retention.sql) opened read-only."""
    try:
        [(seconds, floor)] = con.execute("SELECT retention_s, floor_ns FROM retention").fetchall()
    except duckdb.CatalogException:
        return 0, None
    return seconds, floor


#: Each timed table where its rows are stored, with the column retention drops it by.
TIMED = retention.timed_tables({**LISTS, "spans": SPAN_ROWS})


def journal_loss(damage: journal.Damage, merged: int) -> bool:
    """Whether damaged or missing journal records (``Log.records_after``) held acknowledged batches
    that are not in the tables, whose merges went through record ``merged``."""
    return damage.last_seq is None or damage.last_seq > merged


class DuckDBStore(NamedQueryReader):
    """Both store roles over one DuckDB file (contracts in ``tokentrace.collector.stores.store``)."""

    def __init__(self, path: str | Path, read_only: bool = False, thorough: bool = False):
        self.path = str(path)
        self.read_only = read_only
        #: span files are also checked against the time range listed for them (``tokentrace store repair``)
        self.thorough = thorough
        self._search_path: str | None = None  #: a read-only store's view of moved span files comes first
        try:
            if read_only and not Path(self.path).exists():
                raise NotFound(f"no store file at {self.path}")
            self._con = _attach(self.path, read_only)
        except duckdb.IOException as exc:
            if "lock" in str(exc).lower():
                raise StoreError(
                    f"the store {self.path} is held by a running collector; ask it with --url instead"
                ) from exc
            raise StoreError(f"cannot open the store {self.path}: {exc}") from exc
        # A long migration or query would otherwise draw DuckDB's progress bar on the collector's stdout.
        self._con.execute("SET enable_progress_bar = false")
        if not read_only:
            # DuckDB checkpoints whenever its WAL passes 16 MB, rewriting the changed parts of the
            # ART indexes each time; at ingest rates that halved write throughput (measured 21k vs
            # 31k spans/s). A larger WAL costs a longer replay after a crash: seconds. Only the
            # merge thread commits to the tables, so a checkpoint never holds up a sender.
            self._con.execute(f"SET checkpoint_threshold = '{CHECKPOINT_THRESHOLD}'")
            # A collector keeps a core busy with HTTP, decoding and the journal; DuckDB's own threads
            # beyond the others only contend with it: on 2 cores, 1 thread instead of 2 made the
            # merge's inserts and commits 5.7 instead of 9.0 us of CPU per engine span (measured).
            self._con.execute(f"SET threads = {max(1, (os.cpu_count() or 2) - 1)}")
            self._migrate()
        self._local = threading.local()
        self._pool, self._pool_lock = None, threading.Lock()
        self._queries = sqlfiles.NamedQueries("duckdb", "DuckDB")
        self._columns()
        self._journal: Journal | None = None
        #: what the store could not keep, set aside with what was lost (collector/stores/quarantine.py)
        self._quarantine = Quarantine(Path(self.path + ".quarantine"))
        self._span_files = self._open_span_files()
        if read_only:  # no writer state: reading rows needs no numpy, polars or pyarrow
            if any(Path(self.path + ".journal").glob("*.log")):
                log.warning("%s.journal holds batches a collector acknowledged but had not appended to the tables "
                            "when it stopped: this read-only view lacks them; the next collector to open the store "
                            "appends them", self.path)
            return
        _libraries()
        self._recent = frontier.RecentKeys()
        self._inserts = {name: f"INSERT INTO {LISTS.get(name, name)} SELECT * FROM staged" for name in TABLES}
        self._inserts["spans"] = f"INSERT INTO {SPAN_ROWS} SELECT * FROM staged"
        self._merger = _cursor_of(self._con)
        self._compactor = _cursor_of(self._con)
        log_file = journal.Log(Path(self.path + ".journal"))
        merged, recovered, self._seq = self._recover(log_file)
        self._refused = False  #: the latest write failed (a full disk): the next that passes says so to the merge
        self._keys = once.SpanKeys()
        self._keys.load(self._writer_frame("span_key_minutes"),
                        lambda since_ns: self._writer_frame("span_keys_since", since_ns=since_ns))
        for entry in recovered:  # acknowledged, so a resend of their spans must be recognised
            self._keys.add_batch(entry.columns)
        self._journal = journal.Journal(self._merge, log_file, quarantine=self._set_aside)
        self._journal.start(after=merged, pending=recovered)
        self._span_files.start()
        self._disk_budget: int | None = None  #: --max-disk-bytes
        self._usage: tuple[float, int] | None = None  #: (when, bytes) last measured; journaled bytes added since
        self._expired: dict = {}  #: what the last retention pass did (/healthz)
        self._retainer = _cursor_of(self._con)  #: the retention pass's own cursor (``expire``)
        self._expiring = threading.Lock()  #: one pass at a time (the keeper's, or one asked for)
        self._keeper = retention.Keeper(self.expire, lambda: self._retention_s)
        if self._retention_s:
            self._keeper.start()

    # --- schema -----------------------------------------------------------------------------------
    def _migrate(self) -> None:
        con = self._con
        con.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations "
            "(version BIGINT PRIMARY KEY, name VARCHAR NOT NULL, applied_ns BIGINT NOT NULL)"
        )
        applied = {row[0] for row in con.execute("SELECT version FROM schema_migrations").fetchall()}
        for version, name, sql in sqlfiles.migrations("duckdb"):
            if version in applied:
                continue
            if applied:  # a store written by an earlier version: some migrations rebuild a table (seconds)
                log.info("store %s: applying %s", self.path, name)
            try:
                with _transaction(con):
                    con.execute(sql)
                    con.execute("INSERT INTO schema_migrations VALUES (?, ?, ?)", [version, name, time.time_ns()])
            except duckdb.Error as exc:
                raise StoreError(f"migration {name} failed on {self.path}: {exc}") from exc

    def _columns(self) -> None:
        """StoreError unless the file has this version's tables and columns (``check_columns``)."""
        check_columns(self._con, self.path)

    def _open_span_files(self) -> span_files.SpanFiles:
        """The span files the store lists (collector/stores/span_files.py), checked present; a writer deletes
        the ones no transaction listed and points the view ``spans`` at where the files are now (a
        store moved since); a read-only store whose view names another place reads them through a
        view of its own in the session's catalog, searched first."""
        from tokentrace.collector.stores import span_files as parquet_spans  # no pyarrow: a read-only open needs none

        listed = listed_span_files(self._con)
        files = parquet_spans.SpanFiles(Path(self.path + ".spans"), listed, self._swap_span_files)
        self._retention_s, files.floor_ns = retention_of(self._con)
        files.check()
        unsummed = sum(f.crc32 is None for f in listed)
        if unsummed and not self.read_only:
            log.info("store %s: %d of its %d span files were listed before whole-file checksums "
                     "(020_span_file_checksums.sql): their pages are checked, not every byte", self.path, unsummed,
                     len(listed))
        # A read-only open reads no file through pyarrow.
        damaged = files.damaged(full=not self.read_only, ranges=self.thorough)
        if damaged:
            files.files = [f for f in files.files if f.name not in {bad.name for bad, _ in damaged}]
            if self.read_only:
                for bad, why in damaged:
                    log.error("span file %s of %s is damaged (%s): this read-only view lacks its %d spans", bad.name,
                              self.path, why, bad.spans)
            else:
                self._quarantine_span_files(files, damaged)
        # A read-only open cannot delist a damaged file: it reads the others through a view of its own.
        current = not (damaged and self.read_only) and \
            spans_view_paths(self._con) == {str(files.folder / f.name) for f in files.files}
        if not self.read_only:
            files.clean()
            if not current:
                log.info("store %s: its span files are now in %s", self.path, files.folder)
                self._con.execute(f"CREATE OR REPLACE VIEW spans AS {files.view(files.files)}")
        elif not current:
            self._con.execute(f"CREATE VIEW memory.main.spans AS {files.view(files.files, f'{_ALIAS}.main.')}")
            self._search_path = f"memory.main,{_ALIAS}.main"
            self._con.execute(f"SET search_path = '{self._search_path}'")
        return files

    def _quarantine_span_files(self, files: span_files.SpanFiles,
                               damaged: list[tuple[span_files.SpanFile, str]]) -> None:
        """Move each damaged span file to the quarantine with what it held, then delist them all
        and define ``spans`` over the others in one transaction (issue 45): the store opens and
        serves everything else. A crash between the two finds the files missing at the next open,
        and quarantines them as such."""
        for bad, why in damaged:
            source = files.folder / bad.name
            self._quarantine.keep(
                "damaged span file", f"spans-{bad.name}" if source.exists() else None,
                source=source if source.exists() else None, why=why, span_file=bad.name, spans=bad.spans,
                min_start_ns=bad.min_start_ns, max_start_ns=bad.max_start_ns,
                start_range_utc=[_utc(bad.min_start_ns), _utc(bad.max_start_ns)], acknowledged_spans_lost=bad.spans,
                note=f"{bad.spans} spans that started from {_utc(bad.min_start_ns)} to {_utc(bad.max_start_ns)} are "
                     "no longer in `spans`; the other tables (requests, phases, steps, ...) keep the rows those "
                     "spans made")
        with _transaction(self._con):
            self._con.execute("DELETE FROM span_files WHERE name IN (SELECT unnest($names))",
                              {"names": [bad.name for bad, _ in damaged]})
            self._con.execute(f"CREATE OR REPLACE VIEW spans AS {files.view(files.files)}")

    def _swap_span_files(self, old: list[span_files.SpanFile], new: span_files.SpanFile,
                         after: list[span_files.SpanFile]) -> None:
        """List ``new`` instead of ``old``, ``after`` being every file then (a compaction; the
        span files' lock held)."""
        cursor = self._compactor
        with _transaction(cursor):
            cursor.execute("DELETE FROM span_files WHERE name IN (SELECT unnest($names))",
                           {"names": [f.name for f in old]})
            self._list_span_file(cursor, new, after)

    def _list_span_file(self, cursor: duckdb.DuckDBPyConnection, new: span_files.SpanFile,
                        every: list[span_files.SpanFile]) -> None:
        """In ``cursor``'s transaction: list ``new`` and define ``spans`` over ``every`` file."""
        cursor.execute(span_files.INSERT, new.row())
        cursor.execute(f"CREATE OR REPLACE VIEW spans AS {self._span_files.view(every)}")

    # --- writer role ------------------------------------------------------------------------------
    def write(self, batch: Columns | Batch, spool: SpoolRecord | None = None,
              on_released: Callable[[], None] | None = None) -> bool:
        """Store ``batch`` (TraceWriter contract): in the journal when this returns, in the tables
        for every reader of this store, and ``on_released`` called once the merge thread appended it
        or the journal spilled its columns to disk (collector/stores/journal.py)."""
        columns = as_columns(batch)
        try:
            self._journal.make_room()
            unmerged = self._journal.unmerged()  # before the lookups: what the tables may not hold yet
            if spool is not None and (self._spool_stored(spool.sha256)
                                      or any(e.spool and e.spool.sha256 == spool.sha256 for e in unmerged)):
                _call(on_released)
                return False
            # Exactly once per span (once.py): rows of spans already stored are left out.
            once.drop_stored(columns, self._keys,
                             lambda starts, traces: self._stored_keys(starts, traces) | _keys_in(unmerged, traces))
            if not columns.tables and spool is None:
                _call(on_released)
                return True
            payload = _record(columns, spool)
            size = sum(len(piece) for piece in payload)
            free = disk_free(self.path)
            if free is not None and free < MIN_FREE_BYTES + 2 * size:  # its merge needs as much again
                raise StoreError(f"the disk holding {self.path} has {free} bytes free: not enough to journal and "
                                 f"append {size} bytes")
            self._check_budget(2 * size)
            # A copy: the caller may write the same object again, and a write changes it in place;
            # and once journaled, its sources are not needed in memory.
            entry = journal.Entry(self._seq + 1, dataclasses.replace(columns, sources=None), columns.nbytes, spool,
                                  on_released)
            self._journal.add(entry, payload)
        except Overloaded:
            raise
        except StoreError:
            self._refused = True
            raise
        except Exception as exc:  # I/O: a full disk, a journal that cannot be written
            self._refused = True
            raise write_failure(exc, f"writing {columns.spans} spans to {self.path} failed: {exc}") from exc
        finally:
            if columns is not batch:  # the contract's in-place counts, for a caller's Batch
                batch.spans, batch.duplicates = columns.spans, columns.duplicates
        self._seq += 1
        if self._usage is not None:  # in the journal now, and in DuckDB's WAL once merged
            self._usage = (self._usage[0], self._usage[1] + 2 * size)
        self._keys.add_batch(columns)
        if self._refused:  # the disk takes writes again: a merge that failed meanwhile need not wait
            self._refused = False
            self._journal.retry_now()
        return True

    def _spool_stored(self, sha256: str) -> bool:
        return bool(self._con.execute("SELECT 1 FROM spool_files WHERE sha256 = ?", [sha256]).fetchall())

    def _merge(self, entries: list[Entry]) -> None:
        """Append journaled batches to the tables and record the last one's number, in one
        transaction; their spans, when there are enough of them, to a span file that the same
        transaction lists (collector/stores/span_files.py)."""
        cursor = self._merger
        columns = Columns.concat([entry.load() for entry in entries])
        spans = columns.tables.get("spans")
        files = self._span_files
        written = None
        if spans is not None and spans.num_rows >= span_files.MIN_SPANS and files.enabled:
            written = files.write(spans, f"{entries[-1].seq:0{span_files.SEQ_DIGITS}d}.parquet")
        with files.lock:  # the view is redefined by one transaction at a time
            try:
                with _transaction(cursor):
                    self._append(cursor, columns, spans=written is None)
                    for entry in entries:
                        if entry.spool is not None:
                            cursor.execute("INSERT INTO spool_files VALUES (?, ?, ?, ?)",
                                           [entry.spool.sha256, entry.spool.name, entry.spans, time.time_ns()])
                    if written is not None:
                        self._list_span_file(cursor, written, [*files.files, written])
                    cursor.execute("UPDATE journal_state SET merged_seq = ?, journaled_seq = ?",
                                   [entries[-1].seq, max(entries[-1].seq, self._journal.journaled)])
            except Exception:
                with contextlib.suppress(duckdb.Error):
                    cursor.unregister("staged")
                if written is not None:
                    files.discard(written)
                self._recent = frontier.RecentKeys()  # keys of the rolled-back rows must be recorded again
                raise
            if written is not None:
                files.listed(written)

    def _append(self, cursor: duckdb.DuckDBPyConnection, columns: Columns, spans: bool = True) -> None:
        """One INSERT per table (``spans``: the span rows too); packed block lists get their first
        new block (collector/stores/frontier.py)."""
        for name, rows in columns.tables.items():
            if name == "spans" and not spans:
                continue
            # One chunk a column instead of one a batch (~460 spans): DuckDB scans an Arrow table
            # chunk by chunk, paying for each; the copy is dropped after its insert, one table at a
            # time (issue 17, fifteenth round: the merge 12 % less CPU, copy included).
            rows = rows.combine_chunks()
            if name == "prefix_blocks":
                fresh_from, fresh_hash = frontier.fresh_frontiers(rows, self._recent)
                rows = rows.append_column("fresh_from", fresh_from).append_column("fresh_hash", fresh_hash)
            cursor.register("staged", rows)
            cursor.execute(self._inserts[name])
            cursor.unregister("staged")

    def _recover(self, log_file: Log) -> tuple[int, list[Entry], int]:
        """The last sequence number in the tables, the journal's batches beyond it (a collector
        stopped before merging them), in order, and the highest sequence number the journal used:
        the merge thread appends them first, before anything written after this open, and retries
        while that fails (a full disk), so that an open never fails for want of room to append
        them; /healthz says so meanwhile.

        What does not read back is quarantined, never replayed into the same wall at every start
        nor allowed to cost the records after it (issue 45, collector/stores/quarantine.py): damaged bytes
        of the journal with their byte range and the records they held, records missing (sequence
        numbers that skip, a journal that ends before the last acknowledged record a merge saw),
        and a record whose batch the store cannot hold."""
        [(merged, journaled)] = self._con.execute("SELECT merged_seq, journaled_seq FROM journal_state").fetchall()
        entries, highest = [], max(merged, journaled)
        for seq, data in log_file.records_after(merged, self._damaged(merged), expected=journaled):
            highest = max(highest, seq)
            try:
                columns, spool = _read_record(data)
            except PayloadError as exc:
                self._quarantined_record(seq, data, str(exc), first=not entries)
                continue
            entries.append(journal.Entry(seq, columns, len(data), spool))
        if entries:
            log.warning("the journal of %s holds %d acknowledged batches not yet in its tables; appending them",
                        self.path, len(entries))
        return merged, entries, max(highest, entries[-1].seq if entries else 0)

    def _damaged(self, merged: int) -> Callable[[journal.Damage], None]:
        """What to do with a part of the journal that does not read back (``Log.records_after``)."""

        def damaged(damage: journal.Damage) -> None:
            lost = journal_loss(damage, merged)
            facts = {"journal_file": str(damage.path), "first_seq": damage.first_seq, "last_seq": damage.last_seq,
                     "why": damage.why, "acknowledged_batches_lost": lost,
                     "note": "acknowledged batches not in the tables are lost" if lost
                     else "these records were already in the tables: nothing is lost"}
            if damage.end > damage.start >= 0:
                with open(damage.path, "rb") as handle:
                    handle.seek(damage.start)
                    data = handle.read(damage.end - damage.start)
                name = f"journal-{damage.path.stem}-{damage.start}-{damage.end}.bytes"
                if not (self._quarantine.folder / name).exists():  # a later start finds the same bytes
                    self._quarantine.keep("damaged journal bytes", name, data, byte_range=[damage.start, damage.end],
                                          **facts)
            elif lost:
                self._quarantine.keep("missing journal records", **facts)

        return damaged

    def _quarantined_record(self, seq: int, data: memoryview | bytes, why: str, first: bool) -> None:
        """Set aside journal record ``seq``; when no earlier record is still to merge (``first``),
        the tables record it as passed, so the next start does not read it again."""
        name = f"journal-record-{seq:020d}.bin"
        if not (self._quarantine.folder / name).exists():
            self._quarantine.keep("journal record the store cannot take", name, data, seq=seq, why=why,
                                  acknowledged_batches_lost=True)
        if first:
            self._con.execute("UPDATE journal_state SET merged_seq = greatest(merged_seq, ?)", [seq])

    def _set_aside(self, entry: Entry, exc: Exception) -> bool:
        """The merge thread's: quarantine ``entry``, which failed alone ``QUARANTINE_AFTER`` times
        with ``exc``, unless that is a condition that passes (an I/O error: a full disk)."""
        if isinstance(exc, (OSError, duckdb.IOException)) or "No space left" in str(exc):
            return False
        data = self._journal.log.record(entry.seq)
        name = f"journal-record-{entry.seq:020d}.bin"
        self._quarantine.keep("journal record the store cannot take", name, data if data is not None else b"",
                              seq=entry.seq, spans=entry.spans, why=f"{type(exc).__name__}: {exc}",
                              acknowledged_batches_lost=True)
        with _transaction(self._merger):
            self._merger.execute("UPDATE journal_state SET merged_seq = ?", [entry.seq])
        return True

    def losses(self) -> list[dict]:
        """What the store set aside and lost (its quarantine's ``losses.jsonl`` entries, oldest first;
        /metrics counts them)."""
        return self._quarantine.entries()

    def limit_memory(self, limit_bytes: int) -> None:
        """Bound DuckDB's own memory (its cache of the file, data not yet checkpointed, query state;
        past it DuckDB evicts or spills to ``FILE.tmp``). Unbounded, it grows with what is stored
        up to 80 % of the machine's memory: measured 15 MB per 8k engine spans written."""
        self._con.execute(f"SET memory_limit = '{int(limit_bytes)}B'")

    def hold_unmerged(self, limit_bytes: int) -> None:
        """Hold at most ``limit_bytes`` of acknowledged columns in memory until they are merged: past
        it a write waits, then is refused, or while a merge is held up is spilled to disk
        (collector/stores/journal.py)."""
        if self._journal is not None:
            self._journal.max_bytes = limit_bytes

    # --- retention and the disk budget (collector/stores/retention.py) -----------------------------
    def retain(self, seconds: int) -> None:
        """Keep ``seconds`` of data from now on (0: everything); the store remembers it."""
        if self.read_only:
            raise StoreError(f"{self.path} is open read-only: its retention stays {self._retention_s} s")
        if seconds != self._retention_s:
            log.info("store %s: retention %s (was %s)", self.path, f"{seconds} s" if seconds else "off",
                     f"{self._retention_s} s" if self._retention_s else "off")
            self._con.execute("UPDATE retention SET retention_s = ?", [seconds])
            self._retention_s = seconds
        if seconds:
            self._keeper.start()

    def expire(self, floor_ns: int) -> dict:
        """One retention pass: every row, span and span file that started before ``floor_ns`` goes,
        in one transaction with the span files' lock held, and the block lists' first new blocks are
        kept right (collector/stores/retention.py); then a checkpoint gives the space back to DuckDB.
        What it dropped (also on /healthz)."""
        started = time.monotonic()
        files = self._span_files
        with self._expiring, files.lock:
            cursor = self._retainer
            before = files.floor_ns
            floor = max(floor_ns, before or floor_ns)  # a longer retention brings nothing back
            gone = [f for f in files.files if f.max_start_ns < floor]
            kept = [f for f in files.files if f.max_start_ns >= floor]
            rows: dict[str, int] = {}
            try:
                with _transaction(cursor):
                    moved = 0
                    if cursor.execute("SELECT 1 FROM prefix_block_lists WHERE t_ns < $floor LIMIT 1",
                                      {"floor": floor}).fetchall():  # else no first holder goes
                        cursor.execute(retention.REFRESH_FRONTIERS, {"floor": floor})
                        [(moved,)] = cursor.execute("SELECT count(*) FROM temp.retention_frontiers").fetchall()
                        cursor.execute(retention.APPLY_FRONTIERS)
                        cursor.execute("DROP TABLE temp.retention_frontiers")
                    for table, column in TIMED:  # our own names: safe to splice
                        [(count,)] = cursor.execute(f"DELETE FROM {table} WHERE {column} < $floor",
                                                    {"floor": floor}).fetchall()
                        if count:
                            rows[table] = count
                    if gone:
                        cursor.execute("DELETE FROM span_files WHERE name IN (SELECT unnest($names))",
                                       {"names": [f.name for f in gone]})
                    files.floor_ns = floor
                    cursor.execute(f"CREATE OR REPLACE VIEW spans AS {files.view(kept)}")
                    cursor.execute("UPDATE retention SET floor_ns = ?, pass_ns = ?", [floor, time.time_ns()])
            except BaseException:
                files.floor_ns = before
                raise
            files.expire(gone)
            # A block that only deleted rows held is new again for the next row that holds it.
            self._recent = frontier.RecentKeys()
        checkpointed = self._checkpoint(cursor)
        self._usage = None
        done = {"floor_utc": _utc(floor), "floor_ns": floor, "rows": rows, "span_files": len(gone),
                "file_spans": sum(f.spans for f in gone), "frontiers_moved": moved, "checkpointed": checkpointed,
                "seconds": round(time.monotonic() - started, 3)}
        self._expired = done
        if rows or gone:
            log.info("retention of %s: dropped %d rows (%d requests) and %d span files (%d spans) that started "
                     "before %s, in %.2f s", self.path, sum(rows.values()), rows.get("requests", 0), len(gone),
                     done["file_spans"], done["floor_utc"], done["seconds"])
        return done

    def _checkpoint(self, cursor: duckdb.DuckDBPyConnection) -> bool:
        """CHECKPOINT after a pass, so that DuckDB reuses the deleted rows' blocks and its WAL starts
        again. DuckDB refuses while another connection's write transaction is open (a merge, seen in
        a soak: the WAL then grew to 82 MiB between its own 256 MB checkpoints): tried again
        ``retention.CHECKPOINT_TRIES`` times, ``retention.CHECKPOINT_PAUSE_S`` apart, outside the span
        files' lock; False when none ran."""
        for attempt in range(retention.CHECKPOINT_TRIES):
            try:
                cursor.execute("CHECKPOINT")
                return True
            except duckdb.TransactionException as exc:
                if attempt + 1 == retention.CHECKPOINT_TRIES:
                    log.info("no checkpoint after the retention pass of %s (%s): DuckDB frees the deleted rows' "
                             "blocks at its next one", self.path, exc)
                    return False
                time.sleep(retention.CHECKPOINT_PAUSE_S)  # a retry's pause: another connection's commit ends
        return False

    def limit_disk(self, limit_bytes: int) -> None:
        """Refuse writes (503 + Retry-After) while the store would use more than ``limit_bytes``
        (``usage``), as on a full disk; /healthz says so meanwhile."""
        self._disk_budget = limit_bytes

    def usage(self, cursor: duckdb.DuckDBPyConnection | None = None) -> dict[str, int]:
        """Bytes the store uses on disk: the blocks of its file that DuckDB uses (the free ones it
        reuses are not counted), its WAL, journal, span files, quarantine and spill files; ``total``."""
        cursor = cursor or self._thread_cursor()
        [(block_size, used)] = cursor.execute(
            "SELECT block_size, used_blocks FROM pragma_database_size() WHERE database_name = current_database()"
        ).fetchall()
        found = {"file_blocks": block_size * used, **retention.files_usage(self.path)}
        return {**found, "total": sum(found.values())}

    def _check_budget(self, size: int) -> None:
        """StoreError unless ``size`` more bytes fit the disk budget (the writer's thread)."""
        if self._disk_budget is None:
            return
        now = time.monotonic()
        if self._usage is None or now - self._usage[0] > retention.USAGE_TTL_S:
            self._usage = (now, self.usage(self._con)["total"])
        used = self._usage[1]
        if used + size > self._disk_budget and self._journal.log.retire(self._journal.merged):
            self._usage = (now, used := self.usage(self._con)["total"])
        if used + size > self._disk_budget:
            raise StoreError(f"the store {self.path} uses {used} of the {self._disk_budget} bytes --max-disk-bytes "
                             f"allows: not enough to journal and append {size} bytes"
                             + (f" until retention ({self._retention_s} s) drops older data" if self._retention_s
                                else "; give it a --retention or a larger budget"))

    def _writer_frame(self, name: str, **params) -> pl.DataFrame:
        """A named query on the write connection (inside the writer's transaction)."""
        sql, params = bind_lists(self._queries.text(name), params)
        return self._con.sql(sql, params=params).pl()

    def _stored_keys(self, starts: list[int], traces: list[str]) -> set[tuple[str, str]]:
        # Rows, not a polars frame: the frame cost ~3 ms a call whatever it held (a call per batch of
        # late spans on the writer thread).
        rows = self._con.execute(self._queries.text("span_keys"),
                                 {"starts": starts, "traces": traces}).fetchall()
        return {(trace, span) for trace, span, _ in rows}

    def settle(self) -> None:
        """Wait until what was written before this call is in the tables (collector/stores/journal.py); a
        thread that said ``read_patiently`` waits for the merge thread's own pace; inside ``settled``
        it does not wait again."""
        if self._journal is not None and not getattr(self._local, "settled", False):
            self._journal.settle(urgent=not getattr(self._local, "patient", False))

    @contextlib.contextmanager
    def settled(self) -> Iterator[None]:
        """Settle once, then read what is merged without waiting for later writes (this thread, in the
        block): for a reader whose facts were all written before the block began. /metrics' verdicts
        waited for a merge at each of their dozen reads while engines kept writing (issue 44: 62
        pending 9 minutes into traffic)."""
        self.settle()
        self._local.settled = True
        try:
            yield
        finally:
            self._local.settled = False

    def read_patiently(self) -> None:
        """This thread's reads wait for merges as the merge thread gathers them, never starting one
        early: for a background reader (the /metrics verdict thread) whose reads during ingest would
        otherwise keep every merge small."""
        self._local.patient = True

    def journal_state(self) -> dict | None:
        """Unmerged batches, their bytes and the last merge error (None for a read-only store)."""
        if self._journal is None:
            return None
        return {**self._journal.snapshot(), "span_files": self._span_files.snapshot(),
                "quarantine": self._quarantine.snapshot(),
                "retention": {"seconds": self._retention_s, "floor_utc": _utc(self._span_files.floor_ns),
                              "last_pass": self._expired},
                "disk": {**self.usage(), "budget": self._disk_budget}}

    def close(self) -> None:
        """Merge what is journaled, stop compacting, checkpoint (so the file needs no WAL) and close."""
        with self._pool_lock:
            if self._pool is not None:  # reads still running finish first
                self._pool.shutdown(wait=True)
                self._pool = None
        try:
            if self._journal is not None:
                self._keeper.close()
                self._journal.close()
                if self._journal.unmerged():
                    log.error("the journal of %s keeps %d batches: they are appended at its next open",
                              self.path, len(self._journal.unmerged()))
                self._span_files.close()
            if not self.read_only:
                self._con.execute("CHECKPOINT")
            self._con.close()
        except duckdb.Error as exc:
            raise StoreError(f"closing {self.path} failed: {exc}") from exc

    def probe(self) -> None:
        """Raise StoreError unless the store answers and its disk has room (health check)."""
        try:
            self._thread_cursor().execute("SELECT 1").fetchall()
        except duckdb.Error as exc:
            raise StoreError(f"the store {self.path} does not answer: {exc}") from exc
        if self._journal is not None and self._journal.error is not None:
            raise StoreError(f"appending journaled batches to the tables of {self.path} fails: {self._journal.error}")
        if not self.read_only:
            free = disk_free(self.path)
            if free is not None and free < MIN_FREE_BYTES:
                raise StoreError(f"the disk holding {self.path} has {free} bytes free: writes would fail "
                                 f"(at least {MIN_FREE_BYTES} needed)")
            if self._disk_budget is not None:
                used = self.usage()["total"]
                if used + MIN_FREE_BYTES > self._disk_budget:
                    raise StoreError(f"the store {self.path} uses {used} of the {self._disk_budget} bytes "
                                     "--max-disk-bytes allows: writes would fail")

    # --- reader role ------------------------------------------------------------------------------
    def _cursor(self) -> duckdb.DuckDBPyConnection:
        """This thread's reader cursor, once what was written before is in the tables (``settle``)."""
        self.settle()
        return self._thread_cursor()

    def _thread_cursor(self) -> duckdb.DuckDBPyConnection:
        cursor = getattr(self._local, "cursor", None)
        if cursor is None:
            cursor = self._local.cursor = _cursor_of(self._con, self._search_path)
        return cursor

    def together(self, *reads: Callable[[], T]) -> list[T]:
        """Run reads that do not depend on one another at once: the first in this thread, the others
        in the store's reader threads, each with a cursor of its own. DuckDB releases the GIL while
        it executes, so a cache verdict's branches overlap on a machine with a core to spare.

        One after the other, in this thread, for a patient reader (``read_patiently``: /metrics'
        verdict thread, which yields to ingest by pausing in proportion to each verdict's wall time;
        reads at once made its verdicts shorter but no cheaper, so it took a larger share of the
        CPU: ingest's p99 126-136 against 70-79 ms, measured) and for a read that is itself one of
        them (no thread waits on its own pool)."""
        if len(reads) < 2 or getattr(self._local, "helper", False) or getattr(self._local, "patient", False):
            return [read() for read in reads]

        def helper(read: Callable[[], T]) -> T:
            self._local.helper = True
            return read()

        with self._pool_lock:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor
                self._pool = ThreadPoolExecutor(max_workers=READER_THREADS, thread_name_prefix="tokentrace-read",
                                                initializer=name_os_thread)
            futures = [self._pool.submit(helper, read) for read in reads[1:]]
        try:
            first = reads[0]()
        finally:
            for future in futures:  # none outlives the call that started it
                future.exception()
        return [first, *(future.result() for future in futures)]

    def _fetch(self, name: str, params: dict) -> tuple[list, list[tuple]]:
        """Run a named query with bound parameters: the cursor's description and its rows as tuples."""
        cursor = self._cursor()
        sql, params = bind_lists(self._queries.text(name), params)
        try:
            rows = cursor.execute(sql, params).fetchall()
        except duckdb.Error as exc:
            raise StoreError(f"query {name} failed: {exc}") from exc
        return cursor.description, rows

    def rows(self, name: str, **params) -> list[dict]:
        """Run a named query with bound parameters; its rows as dicts, fetched as Python tuples."""
        description, rows = self._fetch(name, params)
        names = [column[0] for column in description]
        return [dict(zip(names, row, strict=True)) for row in rows]

    def frame(self, name: str, **params) -> pl.DataFrame:
        """Run a named query with bound parameters (small results: row fetch, the cheapest path)."""
        _libraries()
        description, rows = self._fetch(name, params)
        # The result's own types, not types inferred from the rows: an empty result or an all-NULL
        # column must keep its dtype (reader contract; tests/test_store_conformance.py).
        names = [column[0] for column in description]
        frame = pl.DataFrame(rows, schema=names, orient="row", infer_schema_length=None)
        known = {name: dtype for name, kind in zip(names, description, strict=True)
                 if (dtype := _polars_type(str(kind[1]))) is not None}
        return frame.cast(known)

    def bulk(self, name: str, **params) -> pl.DataFrame:
        """Run a named query whose result is large: columnar transfer through Arrow."""
        _libraries()
        try:
            sql, params = bind_lists(self._queries.text(name), params)
            return self._cursor().sql(sql, params=params).pl()
        except duckdb.Error as exc:
            raise StoreError(f"query {name} failed: {exc}") from exc

    def counts(self) -> dict[str, int]:
        """Rows per table."""
        cursor = self._cursor()
        try:
            return {t: cursor.execute(f"SELECT count(*) FROM {t}").fetchall()[0][0] for t in TABLES}
        except duckdb.Error as exc:
            raise StoreError(f"counting rows failed: {exc}") from exc

