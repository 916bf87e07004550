"""The embedded DuckDB store: one file, numbered migrations, Arrow appends, per-thread readers.

DuckDB lets one process open a file for writing; other processes can open it read-only only while
no writer holds it. So ``tokentrace analyze --db`` works on a stopped collector's file, and
``--url`` asks the running collector.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

from tokentrace.collector import sqlfiles
from tokentrace.collector.store import NamedQueryReader, SpoolRecord, arrow_rows, packed_schemas, write_failure
from tokentrace.collector.tables import PACKED, TABLES
from tokentrace.errors import NotFound, StoreError

if TYPE_CHECKING:
    from tokentrace.collector.normalize import Batch

#: numpy, polars, pyarrow and the writer's exactly-once module, bound by ``_libraries()`` for the
#: writer and for frames: a read-only store answering ``rows()`` (``tokentrace analyze --db``)
#: imports none of them (issue 17).
np = pl = pa = pc = once = None


def _libraries() -> None:
    global np, pl, pa, pc, once
    if once is None:
        import numpy
        import polars
        import pyarrow
        import pyarrow.compute

        from tokentrace.collector import once as exactly_once

        np, pl, pa, pc, once = numpy, polars, pyarrow, pyarrow.compute, exactly_once

CHECKPOINT_THRESHOLD = "256MB"
#: Free bytes below which /healthz says the store is not writable: the WAL of one group of writes
#: needs about this much, and a checkpoint more.
MIN_FREE_BYTES = 1 << 20


def disk_free(path: str) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of ``path`` (None: unknown)."""
    try:
        stat = os.statvfs(Path(path).resolve().parent)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize
def _arrow_types() -> dict:
    return {
        "VARCHAR": pa.string(),
        "BIGINT": pa.int64(),
        "INTEGER": pa.int32(),
        "DOUBLE": pa.float64(),
        "BOOLEAN": pa.bool_(),
        "VARCHAR[]": pa.list_(pa.string()),
        "DOUBLE[]": pa.list_(pa.float64()),
    }


def _polars_type(duckdb_type: str) -> pl.DataType | None:
    """The polars dtype of a DuckDB result type; None for types left to polars' inference."""
    if duckdb_type.endswith("[]"):
        inner = _polars_type(duckdb_type[:-2])
        return None if inner is None else pl.List(inner)
    return {"VARCHAR": pl.String, "BIGINT": pl.Int64, "INTEGER": pl.Int32, "DOUBLE": pl.Float64, "BOOLEAN": pl.Boolean,
            "HUGEINT": pl.Int128, "UBIGINT": pl.UInt64, "FLOAT": pl.Float32}.get(duckdb_type)


SIGHTING_COLUMNS = ("hash", "block_index", "t_ns", "request_id", "instance_id", "source", "fingerprint")
_MIX = 0x9E3779B97F4A7C15  # a numpy uint64 where used: numpy loads with the writer


def _salt(instance_id: str | None, source: str | None) -> int:
    """A stable 64-bit number for one (instance, source) pair, mixed into the block hash's key."""
    text = "\x00".join("\x01" if part is None else "\x02" + part for part in (instance_id, source))
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def first_sightings(staged: pa.Table, recent: RecentKeys) -> pa.Table | None:
    """The prefix_sightings rows of staged packed prefix_blocks (normalize.PACKED): for each
    (hash, instance_id, source), its earliest block (least t_ns; ties keep the first staged), kept
    only when ``recent`` has not recorded the key lately. None when there is nothing to append."""
    _libraries()
    lists = staged.column("hashes").combine_chunks()
    if not len(lists):
        return None
    parent = pc.list_parent_indices(lists).to_numpy()
    hashes = pc.list_flatten(lists).to_numpy()
    if not len(hashes):
        return None
    offsets = lists.offsets.to_numpy().astype(np.int64)
    offsets = offsets[:-1] - offsets[0]  # an Array may be a slice of a larger one
    index = np.arange(len(hashes), dtype=np.int64) - offsets[parent]
    t_ns = staged.column("t_ns").to_numpy()[parent]
    pairs: dict[tuple, int] = {}
    group_of_row = np.fromiter(
        (pairs.setdefault(pair, len(pairs)) for pair in zip(staged.column("instance_id").to_pylist(),
                                                             staged.column("source").to_pylist(), strict=True)),
        dtype=np.int64, count=staged.num_rows)
    salts = np.array([_salt(*pair) for pair in pairs], dtype=np.uint64)
    group = group_of_row[parent]
    order = np.lexsort((t_ns, group, hashes))  # by hash, then pair, then time; stable
    sorted_hash, sorted_group = hashes[order], group[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = (sorted_hash[1:] != sorted_hash[:-1]) | (sorted_group[1:] != sorted_group[:-1])
    picked = order[first]
    keys = (hashes[picked].view(np.uint64) ^ salts[group[picked]]) * np.uint64(_MIX)
    keys ^= keys >> np.uint64(31)
    picked = picked[recent.fresh(keys)]
    if not len(picked):
        return None
    rows = pa.array(parent[picked])
    return pa.table({
        "hash": pa.array(hashes[picked]), "block_index": pa.array(index[picked]), "t_ns": pa.array(t_ns[picked]),
        "request_id": staged.column("request_id").take(rows), "instance_id": staged.column("instance_id").take(rows),
        "source": staged.column("source").take(rows), "fingerprint": staged.column("fingerprint").take(rows),
    })
_LIST_PARAM = re.compile(r"\$([a-z_][a-z0-9_]*)\[\]")


def bind_lists(sql: str, params: dict) -> tuple[str, dict]:
    """Expand each ``$name[]`` of a named query into one bound parameter per element of the list
    ``params[name]`` (``NULL`` for an empty list): DuckDB's planner uses an ART index for an IN list
    of values, and scans the table for ``= ANY($list)``."""
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

    return _LIST_PARAM.sub(expand, sql), bound


class RecentKeys:
    """64-bit keys recorded lately, in two generations of about ``capacity`` keys each: a key in
    either is a repeat, every key offered joins the new generation (so recurring keys stay), and
    when the new generation is full the old one is dropped. A key that returns after two
    generations is recorded once more, which costs a row and changes no answer. Generations are
    sorted numpy arrays probed with ``searchsorted``: a few microseconds per thousand keys."""

    def __init__(self, capacity: int = 1_000_000):
        _libraries()
        self.capacity = capacity
        self._new = np.empty(0, dtype=np.uint64)  # sorted
        self._pending: list[np.ndarray] = []  # sorted chunks not yet folded into _new
        self._new_size = 0
        self._old = np.empty(0, dtype=np.uint64)  # sorted

    @staticmethod
    def _among(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
        if not len(sorted_keys):
            return np.zeros(len(keys), dtype=bool)
        at = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
        return sorted_keys[at] == keys

    def fresh(self, keys: np.ndarray) -> np.ndarray:
        """Mask of the (distinct) ``keys`` not recorded lately; all of them count as recorded now."""
        # Probed in sorted order: numpy's binary search then starts from the previous key's place,
        # 5-10 times as fast as random probes into a generation of a million keys (measured).
        order = np.argsort(keys)
        probe = keys[order]
        seen_sorted = self._among(self._old, probe) | self._among(self._new, probe)
        for chunk in self._pending:
            seen_sorted |= self._among(chunk, probe)
        seen = np.empty_like(seen_sorted)
        seen[order] = seen_sorted
        self._pending.append(probe)
        self._new_size += len(keys)
        if len(self._pending) >= 8 or self._new_size >= self.capacity:  # fold: one probe per generation
            self._new, self._pending = _merge(self._new, self._pending), []
        if self._new_size >= self.capacity:
            distinct = np.ones(len(self._new), dtype=bool)
            distinct[1:] = self._new[1:] != self._new[:-1]
            self._old = self._new[distinct]
            self._new, self._new_size = np.empty(0, dtype=np.uint64), 0
        return ~seen


def _merge(sorted_keys: np.ndarray, chunks: list[np.ndarray]) -> np.ndarray:
    """``sorted_keys`` and the ``chunks`` in one sorted array: the small chunks are sorted together
    and inserted in one pass, linear in the generation's size (sorting the whole generation again
    at every fold took a tenth of the writer's time at a million keys)."""
    small = np.sort(np.concatenate(chunks)) if chunks else np.empty(0, dtype=np.uint64)
    return np.insert(sorted_keys, np.searchsorted(sorted_keys, small), small)


class DuckDBStore(NamedQueryReader):
    """Both store roles over one DuckDB file (contracts in ``tokentrace.collector.store``)."""

    def __init__(self, path: str | Path, read_only: bool = False):
        self.path = str(path)
        self.read_only = read_only
        try:
            if read_only and not Path(self.path).exists():
                raise NotFound(f"no store file at {self.path}")
            self._con = duckdb.connect(self.path, read_only=read_only)
        except duckdb.IOException as exc:
            if "lock" in str(exc).lower():
                raise StoreError(
                    f"the store {self.path} is held by a running collector; ask it with --url instead"
                ) from exc
            raise StoreError(f"cannot open the store {self.path}: {exc}") from exc
        if not read_only:
            # DuckDB checkpoints whenever its WAL passes 16 MB, rewriting the changed parts of the
            # ART indexes each time; at ingest rates that halved write throughput (measured 21k vs
            # 31k spans/s). A larger WAL costs a longer replay after a crash: seconds.
            self._con.execute(f"SET checkpoint_threshold = '{CHECKPOINT_THRESHOLD}'")
            self._migrate()
        self._local = threading.local()
        self._queries = sqlfiles.NamedQueries("duckdb", "DuckDB")
        columns = self._columns()
        if read_only:  # no writer state: reading rows needs no numpy, polars or pyarrow
            return
        _libraries()
        self._schemas = self._arrow_schemas(columns)
        self._expand = {table: sqlfiles.read("duckdb", f"expand/{table}.sql") for table in PACKED}
        self._recent = RecentKeys()
        self._keys = once.SpanKeys()
        if not read_only:
            self._keys.load(self._writer_frame("span_key_minutes"),
                            lambda since_ns: self._writer_frame("span_keys_since", since_ns=since_ns))

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
            try:
                con.execute("BEGIN")
                con.execute(sql)
                con.execute("INSERT INTO schema_migrations VALUES (?, ?, ?)", [version, name, time.time_ns()])
                con.execute("COMMIT")
            except duckdb.Error as exc:
                con.execute("ROLLBACK")
                raise StoreError(f"migration {name} failed on {self.path}: {exc}") from exc

    def _columns(self) -> dict[str, list[tuple[str, str]]]:
        """(name, type) of each table's columns; StoreError unless they are this version's (TABLES).
        One catalog query (1.4 ms; one information_schema query per table took 36 ms of every CLI verdict)."""
        listed: dict[str, list[tuple[str, str]]] = {}
        for table, name, kind in self._con.execute(
            "SELECT table_name, column_name, data_type FROM duckdb_columns() "
            "WHERE database_name = current_database() AND schema_name = 'main' ORDER BY table_name, column_index"
        ).fetchall():
            listed.setdefault(table, []).append((name, kind))
        found = {}
        for table, columns in TABLES.items():
            rows = listed.get(table, [])
            if [name for name, _ in rows] != list(columns):
                raise StoreError(f"table {table} of {self.path} has columns {[n for n, _ in rows]}, "
                                 f"expected {list(columns)}: the file comes from another version")
            found[table] = rows
        return found

    def _arrow_schemas(self, columns: dict[str, list[tuple[str, str]]]) -> dict[str, pa.Schema]:
        types = _arrow_types()
        schemas = {table: pa.schema([(name, types[kind]) for name, kind in rows]) for table, rows in columns.items()}
        return schemas | {"packed:" + table: schema for table, schema in packed_schemas(schemas).items()}

    # --- writer role ------------------------------------------------------------------------------
    def write(self, batch: Batch, spool: SpoolRecord | None = None) -> bool:
        """Store ``batch`` in one committed transaction (TraceWriter contract)."""
        con = self._con
        try:
            con.execute("BEGIN")
            if spool is not None:
                if con.execute("SELECT 1 FROM spool_files WHERE sha256 = ?", [spool.sha256]).fetchall():
                    con.execute("ROLLBACK")
                    return False
                con.execute("INSERT INTO spool_files VALUES (?, ?, ?, ?)",
                            [spool.sha256, spool.name, batch.spans, time.time_ns()])
            # Exactly once per span (once.py): rows of spans already stored are left out.
            once.drop_stored(batch, self._keys, self._stored_keys)
            for table, rows in batch.rows.items():
                if rows:
                    con.from_arrow(self._arrow(table, rows)).insert_into(table)
            for table, rows in batch.packed.items():
                if rows:
                    staged = self._arrow("packed:" + table, rows)
                    con.register("staged", staged)
                    con.execute(self._expand[table])
                    con.unregister("staged")
                    if table == "prefix_blocks":
                        self._record_sightings(con, staged)
            con.execute("COMMIT")
            spans = batch.rows["spans"]
            self._keys.add([r[0] for r in spans], [r[1] for r in spans], [r[5] for r in spans])
            return True
        except Exception as exc:  # whatever failed, the transaction must not outlive this call
            with contextlib.suppress(duckdb.Error):  # the failed statement may have ended it
                con.execute("ROLLBACK")
            with contextlib.suppress(duckdb.Error):
                con.unregister("staged")
            self._recent = RecentKeys()  # keys of the rolled-back rows must be recorded again
            raise write_failure(exc, f"writing {batch.spans} spans to {self.path} failed: {exc}") from exc

    def limit_memory(self, limit_bytes: int) -> None:
        """Bound DuckDB's own memory (its cache of the file, data not yet checkpointed, query state;
        past it DuckDB evicts or spills to ``FILE.tmp``). Unbounded, it grows with what is stored
        up to 80 % of the machine's memory: measured 15 MB per 8k engine spans written."""
        self._con.execute(f"SET memory_limit = '{int(limit_bytes)}B'")

    def _writer_frame(self, name: str, **params) -> pl.DataFrame:
        """A named query on the write connection (inside the writer's transaction)."""
        sql, params = bind_lists(self._queries.text(name), params)
        return self._con.sql(sql, params=params).pl()

    def _stored_keys(self, starts: list[int], traces: list[str]) -> set[tuple[str, str]]:
        rows = self._writer_frame("span_keys", starts=starts, traces=traces)
        return set(zip(rows["trace_id"].to_list(), rows["span_id"].to_list(), strict=True))

    def _record_sightings(self, con: duckdb.DuckDBPyConnection, staged: pa.Table) -> None:
        """Append to prefix_sightings the first row of each (hash, instance, source) among the staged
        blocks that was not recorded lately (003_prefix_sightings.sql), in numpy: a GROUP BY over the
        unnested blocks plus a polars hash cost a quarter of the writer's time (docs/benchmarks.md)."""
        chosen = first_sightings(staged, self._recent)
        if chosen is not None:
            con.from_arrow(chosen).insert_into("prefix_sightings")

    def _arrow(self, schema_name: str, rows: list[tuple]) -> pa.Table:
        return arrow_rows(self._schemas[schema_name], rows)

    def close(self) -> None:
        """Checkpoint (so the file is self-contained) and close."""
        try:
            if not self.read_only:
                self._con.execute("CHECKPOINT")
            self._con.close()
        except duckdb.Error as exc:
            raise StoreError(f"closing {self.path} failed: {exc}") from exc

    def probe(self) -> None:
        """Raise StoreError unless the store answers and its disk has room (health check)."""
        try:
            self._cursor().execute("SELECT 1").fetchall()
        except duckdb.Error as exc:
            raise StoreError(f"the store {self.path} does not answer: {exc}") from exc
        if not self.read_only:
            free = disk_free(self.path)
            if free is not None and free < MIN_FREE_BYTES:
                raise StoreError(f"the disk holding {self.path} has {free} bytes free: writes would fail "
                                 f"(at least {MIN_FREE_BYTES} needed)")

    # --- reader role ------------------------------------------------------------------------------
    def _cursor(self) -> duckdb.DuckDBPyConnection:
        cursor = getattr(self._local, "cursor", None)
        if cursor is None:
            cursor = self._local.cursor = self._con.cursor()
        return cursor

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

