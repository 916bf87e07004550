"""The scale-out store: both roles on ClickHouse, a server over HTTP or chdb in-process.

One code path serves both: clickhouse-connect's client speaks HTTP to a server
(``clickhouse://host:8123/db``) or drives chdb's embedded engine (``chdb:///dir``) through the same
API, so the SQL, parameter binding, Arrow inserts and reads that CI runs on chdb are the ones a
server gets. Schema: ``sql/clickhouse/NNN_*.sql``; named queries: ``sql/clickhouse/queries/``.

Writer guarantees (ClickHouse has no multi-table transactions; compare store.py's contract):
    - ``write`` inserts each non-empty table of the batch as one Arrow INSERT, tables in
      ``WRITE_ORDER`` (``requests`` next to last, ``spans`` last), and returns once every INSERT
      returned: the server has then committed those parts, so an acknowledged batch is complete and
      readable from any collector. A reader that sees a ``requests`` row sees every row its batch
      carried.
    - Exactly once per span (collector/stores/once.py): spans already stored are left out before any
      INSERT. A span counts as stored once its ``spans`` row is in, which is inserted last; each
      table's INSERT carries the deduplication token ``once:<hash of the spans written>:<table>``
      (kept for the last 1000 inserts of each table), so a batch resent after a crash mid-batch
      finds the tables inserted before the crash and the server drops those blocks. The writer
      gives this store one request per write (``group_writes``), so a resend is the same blocks.
    - A deduplication token can outlive the part it names: a non-replicated MergeTree records the
      token in its deduplication log before it commits the part, so a crash between the two leaves
      a token whose rows are gone, and a resend's INSERT with it is dropped while its summary still
      counts the rows written. For ``spans``, which decide what counts as stored:
        - on chdb the crash is this process's (chdb runs in it, and one process holds a data
          directory), so the ``spans`` token also carries an id drawn when the store opens: a
          token logged before a crash is never used after it, and a resend of spans committed
          before it is left out by the span check above, token or not;
        - on a server, which can crash and restart while collectors keep running, ``write`` asks
          the store for the batch's span keys once the ``spans`` INSERT returned (named query
          ``span_keys``, ``once.in_store``) and inserts the missing ones again
          without deduplication.
      The other tables keep tokens that hold across restarts (a resend must not repeat the rows a
      crash mid-batch left), so the rows of the one table whose INSERT was in flight at such a
      crash can still be missing after a resend: not every table has a key to check them by.
    - Spool files are also known by their sha256: a file whose sha256 is in ``spool_files`` is
      skipped, and the ``spool_files`` row goes in after every table.
    - Durability is the server's: an INSERT returns after its part is written, not fsynced
      (ClickHouse's default; the table setting ``fsync_after_insert`` changes that). A collector
      killed with -9 loses nothing acknowledged; a power cut of the database host can lose the
      last parts unless replicated or fsynced.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import clickhouse_connect
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from clickhouse_connect.driver.exceptions import ClickHouseError

from tokentrace.collector.decoding.columns import Columns
from tokentrace.collector.decoding.normalize import Batch
from tokentrace.collector.decoding.tables import PACKED, TABLES
from tokentrace.collector.stores import once, sqlfiles
from tokentrace.collector.stores.store import NamedQueryReader, SpoolRecord, as_columns, packed_schemas, write_failure
from tokentrace.errors import StoreError

log = logging.getLogger("tokentrace.collector")
#: Insert order: ``requests`` next to last, so that a request visible to readers has all its rows;
#: ``spans`` last, so that a span counts as stored (once.py) only once every row it made is in.
WRITE_ORDER = (*(t for t in TABLES if t not in ("requests", "spans")), "requests", "spans")
_ARROW = {"String": pa.string(), "Int64": pa.int64(), "Int32": pa.int32(), "Float64": pa.float64(),
          "Bool": pa.bool_(), "Array(String)": pa.list_(pa.string())}
#: Session settings for readers: SQL-standard NULLs for unmatched outer-join columns, as DuckDB
#: gives. (ClickHouse also lets an output alias shadow a column in WHERE, unlike DuckDB; the twins
#: of such queries alias inside a subquery instead: sql/clickhouse/queries/slot_holders.sql.)
_READ_SETTINGS = {"join_use_nulls": 1}
#: A foreign sender's batch may span many days; ClickHouse would refuse it past 100 partitions.
_INSERT_SETTINGS = {"throw_on_max_partitions_per_insert_block": 0}


@dataclass(frozen=True)
class Target:
    """Where a ClickHouse store lives: a chdb directory or an HTTP server, plus a database."""

    database: str  #: database holding the tables (created if missing)
    path: str | None = None  #: chdb data directory; None for a server
    host: str = "localhost"  #: server host
    port: int = 8123  #: server HTTP port
    username: str = "default"  #: server user
    password: str = ""  #: server password (never shown)
    secure: bool = False  #: HTTPS
    settings: dict = field(default_factory=dict)  #: extra ClickHouse settings for every query

    def label(self) -> str:
        """The store as users named it, without the password."""
        if self.path is not None:
            return f"chdb://{self.path}"
        scheme = "clickhouses" if self.secure else "clickhouse"
        return f"{scheme}://{self.username}@{self.host}:{self.port}/{self.database}"

    def client(self, database: str | None):
        """A new clickhouse-connect client (one per thread: chdb handles and HTTP sessions are not
        meant to be shared by concurrent queries)."""
        settings = {**_READ_SETTINGS, **self.settings}
        if self.path is not None:
            return clickhouse_connect.get_client(interface="chdb", path=self.path, database=database,
                                                 settings=settings)
        return clickhouse_connect.get_client(
            host=self.host, port=self.port, username=self.username, password=self.password,
            database=database, secure=self.secure, settings=settings, autogenerate_session_id=False,
        )


def _arrow_type(ch_type: str) -> pa.DataType:
    for wrapper in ("LowCardinality(", "Nullable("):
        if ch_type.startswith(wrapper):
            return _arrow_type(ch_type[len(wrapper):-1])
    if ch_type.startswith("Array("):
        return pa.list_(_arrow_type(ch_type[6:-1]))
    return _ARROW[ch_type]


class ClickHouseStore(NamedQueryReader):
    """Both store roles over one ClickHouse database (contracts in ``tokentrace.collector.stores.store``;
    what differs from DuckDB is in this module's docstring)."""

    def __init__(self, target: Target, retention_days: int | None = None):
        self.target = target
        self.path = target.label()
        self._clients: list = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._queries = sqlfiles.NamedQueries("clickhouse", "ClickHouse")
        #: The end of the ``spans`` deduplication tokens: an id of this open on chdb, nothing on a
        #: server (module docstring).
        self._life = f":{secrets.token_hex(8)}" if target.path is not None else ""
        try:
            admin = self._track(target.client(None))
            admin.command("CREATE DATABASE IF NOT EXISTS {db:Identifier}", parameters={"db": target.database})
            self._writer = self._track(target.client(target.database))
            self._migrate()
            if retention_days is not None:
                self._retain(retention_days)
            self._schemas = self._arrow_schemas()
            self._keys = once.SpanKeys()
            self._keys.load(self.frame("span_key_minutes"),
                            lambda since_ns: self.frame("span_keys_since", since_ns=since_ns))
        except ClickHouseError as exc:
            self.close()
            raise StoreError(_explain(exc, self.target)) from exc
        except BaseException:
            self.close()
            raise

    def _track(self, client):
        with self._lock:
            self._clients.append(client)
        return client

    # --- schema -----------------------------------------------------------------------------------
    def _migrate(self) -> None:
        con = self._writer
        con.command("CREATE TABLE IF NOT EXISTS schema_migrations (version Int64, name String, "
                    "applied_ns Int64) ENGINE = MergeTree ORDER BY version")
        applied = {row[0] for row in con.query("SELECT DISTINCT version FROM schema_migrations").result_rows}
        for version, name, sql in sqlfiles.migrations("clickhouse"):
            if version in applied:
                continue
            # Statements are idempotent, so a crash (or a second collector) mid-migration re-runs it.
            for statement in sqlfiles.statements(sql):
                con.command(statement)
            con.insert("schema_migrations", [(version, name, time.time_ns())],
                       column_names=["version", "name", "applied_ns"])

    def _retain(self, days: int) -> None:
        """Set the TTL of every timed table to ``days`` (0: keep everything), when it changed."""
        con = self._writer
        current = con.query("SELECT argMax(value, set_ns) FROM store_settings WHERE name = 'retention_days'")
        if current.result_rows and current.result_rows[0][0] == str(days):
            return
        if days:
            for statement in sqlfiles.statements(sqlfiles.read("clickhouse", "ttl.sql")):
                con.command(statement, parameters={"days": days})
        else:
            with_ttl = {row[0] for row in con.query(
                "SELECT name FROM system.tables WHERE database = currentDatabase() "
                "AND position(engine_full, ' TTL ') > 0").result_rows}
            for table in sorted(with_ttl.intersection(TABLES)):  # our own names: safe to splice
                con.command(f"ALTER TABLE {table} REMOVE TTL")
        con.insert("store_settings", [("retention_days", str(days), time.time_ns())],
                   column_names=["name", "value", "set_ns"])

    def _arrow_schemas(self) -> dict[str, pa.Schema]:
        found: dict[str, list[tuple[str, str]]] = {}
        for table, name, kind in self._writer.query(
                "SELECT table, name, type FROM system.columns WHERE database = currentDatabase() "
                "ORDER BY table, position").result_rows:
            found.setdefault(table, []).append((name, kind))
        schemas = {}
        for table, columns in TABLES.items():
            names = [name for name, _ in found.get(table, [])]
            if names != list(columns):
                raise StoreError(f"table {table} of {self.path} has columns {names}, expected "
                                 f"{list(columns)}: the database comes from another version")
            schemas[table] = pa.schema([(name, _arrow_type(kind)) for name, kind in found[table]])
        self._packed = packed_schemas(schemas)
        return schemas

    # --- writer role ------------------------------------------------------------------------------
    #: The writer thread gives this store one batch per write: a resent request is then the same
    #: insert blocks with the same deduplication tokens (see ``write``).
    group_writes = False

    def write(self, batch: Columns | Batch, spool: SpoolRecord | None = None,
              on_released: Callable[[], None] | None = None) -> bool:
        """Insert ``batch`` table by table, ``spans`` last (guarantees in the module docstring);
        every table is written when this returns, so ``on_released`` is called before it does."""
        columns = as_columns(batch)
        try:
            if spool is not None and self.spool_seen(spool.sha256):
                if on_released is not None:
                    on_released()
                return False
            in_file = columns.spans
            once.drop_stored(columns, self._keys, self._stored_keys)
            # One token per table from the keys of the spans written: a resend after a crash
            # mid-batch finds the tables already inserted and the server drops those blocks.
            digest = hashlib.blake2b(columns.keys.astype(np.uint64).tobytes(), digest_size=16).hexdigest()
            settings = {**_INSERT_SETTINGS, "insert_deduplicate": 1}
            for table in WRITE_ORDER:
                data = self._table(columns, table)
                if data is None:
                    continue
                settings["insert_deduplication_token"] = f"once:{digest}:{table}" + (
                    self._life if table == "spans" else "")
                self._writer.insert_arrow(table, data, settings=settings)
            if not self._life:  # a server
                self._confirm_spans(columns)
            if spool is not None:
                self._writer.insert("spool_files", [(spool.sha256, spool.name, in_file, time.time_ns())],
                                    column_names=["sha256", "name", "spans", "ingested_ns"])
            self._keys.add_batch(columns)
        except Exception as exc:
            raise write_failure(exc, f"writing {columns.spans} spans to {self.path} failed: {exc}") from exc
        finally:
            if columns is not batch:  # the contract's in-place counts, for a caller's Batch
                batch.spans, batch.duplicates = columns.spans, columns.duplicates
        if on_released is not None:
            on_released()
        return True

    def _confirm_spans(self, columns: Columns) -> None:
        """Insert again, without deduplication, the spans of ``columns`` that a server does not
        return after their INSERT: a deduplication token left by a part lost in a crash dropped
        them (module docstring). StoreError if they are still missing then."""
        spans = columns.tables.get("spans")
        if spans is None or not spans.num_rows:
            return
        missing = self._missing_spans(spans)
        if not len(missing):
            return
        log.warning("%s dropped %d of %d spans as already inserted, but does not hold them (a part lost in a "
                    "crash after its deduplication token was logged): inserting them again",
                    self.path, len(missing), spans.num_rows)
        self._writer.insert_arrow("spans", self._table(columns, "spans").take(missing),
                                  settings={**_INSERT_SETTINGS, "insert_deduplicate": 0})
        still = self._missing_spans(spans)
        if len(still):
            raise StoreError(f"{self.path} does not return {len(still)} spans of a batch after inserting them twice")

    def _missing_spans(self, spans: pa.Table) -> np.ndarray:
        """Indices of the rows of ``spans`` whose keys the store does not return."""
        rows = np.arange(spans.num_rows)
        return rows[~once.in_store(spans, rows, self._stored_keys)]

    def _stored_keys(self, starts: list[int], traces: list[str]) -> set[tuple[str, str]]:
        rows = self.frame("span_keys", starts=starts, traces=traces)
        return set(zip(rows["trace_id"].to_list(), rows["span_id"].to_list(), strict=True))

    def _table(self, batch: Columns, table: str) -> pa.Table | None:
        rows = batch.tables.get(table)
        if rows is None:
            return None
        if table in PACKED:
            return _expand(table, rows.cast(self._packed[table]))
        return rows.cast(self._schemas[table])

    def close(self) -> None:
        """Close every client (chdb releases its data directory when the last one closes)."""
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()

    def probe(self) -> None:
        """Raise StoreError unless the store answers (health check)."""
        try:
            self._reader().query("SELECT 1")
        except ClickHouseError as exc:
            raise StoreError(f"the store {self.path} does not answer: {exc}") from exc

    # --- reader role ------------------------------------------------------------------------------
    def _reader(self):
        client = getattr(self._local, "client", None)
        if client is None:
            try:
                client = self._local.client = self._track(self.target.client(self.target.database))
            except ClickHouseError as exc:
                raise StoreError(_explain(exc, self.target)) from exc
        return client

    def frame(self, name: str, **params) -> pl.DataFrame:
        """Run a named query with bound parameters."""
        sql = self._queries.text(name)
        try:
            return pl.from_arrow(self._reader().query_arrow(sql, parameters=params or None))
        except ClickHouseError as exc:
            raise StoreError(f"query {name} failed: {exc}") from exc

    def counts(self) -> dict[str, int]:
        """Rows per table."""
        client = self._reader()
        try:
            return {t: client.query("SELECT count() FROM {t:Identifier}", parameters={"t": t}).result_rows[0][0]
                    for t in TABLES}
        except ClickHouseError as exc:
            raise StoreError(f"counting rows failed: {exc}") from exc


def _expand(table: str, packed: pa.Table) -> pa.Table:
    """One row per list element of a packed table (normalize.PACKED), in Arrow compute: the same
    rows as ``Batch.expanded`` and as DuckDB's sql/duckdb/expand/, without a Python loop per token."""
    lists = packed.column(PACKED[table][-1]).combine_chunks()
    parent = pc.list_parent_indices(lists)
    value = pc.list_flatten(lists)
    index = pc.subtract(pa.array(np.arange(len(value), dtype=np.int64)),
                        pc.cast(pc.take(lists.offsets, parent), pa.int64()))

    def of_parent(name: str) -> pa.Array:
        return pc.take(packed.column(name), parent)

    if table == "decode_steps":
        columns = {"step": index, "t_ns": pc.add(of_parent("start_ns"), value)}
    else:
        columns = {"block_index": index, "hash": value}
    return pa.table({name: columns[name] if name in columns else of_parent(name) for name in TABLES[table]})


def _explain(exc: ClickHouseError, target: Target) -> str:
    text, label = str(exc), target.label()
    if target.path is not None and _locked_elsewhere(target.path):
        return (f"the store {label} is held by another process: chdb opens a data directory in one "
                f"process only, so several collectors need a ClickHouse server (docs/scale-out.md)")
    return f"cannot use the store {label}: {text}"


def _locked_elsewhere(path: str) -> bool:
    """Whether another process holds chdb's lock on ``path`` (ClickHouse flocks ``status``)."""
    import fcntl

    try:
        with open(f"{path}/status", "rb") as status:
            fcntl.flock(status, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False
