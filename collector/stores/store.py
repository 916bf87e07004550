"""Store roles. Each caller receives one role: the ingest path a ``TraceWriter``, analyzers and
dashboards a ``TraceReader``. One backend class implements both (``DuckDBStore``,
``ClickHouseStore`` for a ClickHouse server or chdb); every backend passes the same conformance
suite (tests/test_store_conformance.py). Where the backends differ, each item says so.

Writer contract
    - ``write(batch, spool, on_released)`` returns only once every row of ``batch`` is stored
      durably: the HTTP request is acknowledged after that, never before. Readers of the store see
      those rows from then on; ``on_released`` (when given) is called once the store holds none
      of the batch in memory: its rows are in the tables, or (DuckDB) spilled to disk to be
      appended from there; the request's bytes are then released (collector/receiver/budget.py).
        DuckDB: appended to its journal (a log beside the file, one fdatasync) before it returns,
        appended to the tables by the merge thread in a later transaction that also records the
        last journal record merged; a reader waits for that merge (collector/stores/journal.py).
        ClickHouse: one INSERT per table, ``requests`` last, each committed as a part before the
        next; no transaction spans tables (store_clickhouse.py).
    - On failure it raises ``StoreError``.
        DuckDB: nothing of the batch is stored.
        ClickHouse: the tables inserted before the failure stay, ``spans`` last; the sender's retry
        of the same batch carries the same deduplication tokens and the server drops those tables'
        blocks.
    - Exactly once per span (collector/stores/once.py): a span whose (trace id, span id) is stored already
      is left out, with every row it made, before anything is written: ``write`` removes them from
      ``batch`` in place (it then holds what was stored) and sets ``batch.duplicates``. A batch
      written twice is stored once, whatever grouping or path it came by.
        DuckDB: checked and written in one transaction.
        ClickHouse: exact for one collector per store (chdb, or one collector on a server); a
        server shared by several collectors checks what each collector wrote, and what the others
        wrote only for spans it looks up in the store (docs/scale-out.md).
    - Spool files are also known by the sha256 of their bytes: ``write(batch, spool=record)`` with
      a sha256 already stored stores nothing and returns False.
        DuckDB: the sha256 is recorded in the batch's transaction.
        ClickHouse: the sha256 is recorded after every table.
    - One thread calls it (the writer thread); it is not thread-safe.
    - Writers per store: DuckDB and chdb allow one process per file or directory; a ClickHouse
      server takes any number of collectors at once.

Reader contract
    - Reads stored data only: DuckDB committed transactions, after waiting until what was written
      before the read is merged from the journal (so a writer reads its own writes); ClickHouse
      INSERTed parts, so a reader may see the earlier tables of a batch being written, but a
      visible ``requests`` row has all its batch's rows. Row order is only what a query's ORDER BY fixes.
    - An unknown id gives ``None`` (one object) or an empty frame (collections), never an error.
    - Frames carry their documented columns even when empty, with the same dtypes on every
      backend; times are integer nanoseconds.
    - ``frame(name, **params)`` runs the named query ``sql/<backend>/queries/<name>.sql`` with bound
      parameters; every backend ships every named query, and the twins return equal frames.
      ``bulk(name, **params)`` returns the same frame by the backend's columnar path: use it for
      windows of many rows (DuckDB fetches ``frame`` results as Python rows, cheapest when few).
      ``rows(name, **params)`` returns the frame's rows as dicts (``frame(...).to_dicts()``): the
      per-request verdicts read only these, so that DuckDB's (fetched as Python tuples) need no
      polars or pyarrow (``tokentrace analyze --db``, issue 17).
    - Safe from many threads: each thread reads through its own cursor (DuckDB) or client
      (ClickHouse).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from tokentrace.collector.decoding.tables import PACKED
from tokentrace.errors import RejectedBatch, StoreError

T = TypeVar("T")

if TYPE_CHECKING:  # polars and pyarrow where frames and appends are built: reading rows needs neither
    import polars as pl
    import pyarrow as pa

    from tokentrace.collector.decoding.columns import Columns
    from tokentrace.collector.decoding.normalize import Batch


@dataclass(frozen=True)
class SpoolRecord:
    """A spool file being ingested; its hash makes the ingest exactly-once."""

    sha256: str  #: hex digest of the file's bytes
    name: str  #: file name, for the record

    @classmethod
    def of(cls, data: bytes, name: str) -> SpoolRecord:
        """The record of a spool file's bytes, from the spool directory or resent over HTTP alike."""
        return cls(hashlib.sha256(data).hexdigest(), name)


def as_columns(batch: Columns | Batch) -> Columns:
    """The batch as ``Columns`` (a normalizer ``Batch``, as tests and benchmarks build them, is
    converted; its ``spans``/``duplicates`` are the writer's to update afterwards)."""
    from tokentrace.collector.decoding.columns import Columns

    return batch if isinstance(batch, Columns) else batch.columns()


def packed_schemas(schemas: dict[str, pa.Schema]) -> dict[str, pa.Schema]:
    """The Arrow schema of each packed table's rows as the normalizer stages them: the table's own
    column types (``schemas``, read from the store) plus the packed-only columns."""
    import pyarrow as pa

    # Columns that only the packed (pre-expansion) rows carry, and their Arrow types.
    packed_only = {"start_ns": pa.int64(), "offsets": pa.list_(pa.int64()), "hashes": pa.list_(pa.int64())}
    return {table: pa.schema([(name, packed_only.get(name) or schemas[table].field(name).type) for name in columns])
            for table, columns in PACKED.items()}


def write_failure(exc: BaseException, message: str) -> StoreError | RejectedBatch:
    """The error a failed write raises: RejectedBatch (permanent, 400) for a value the store cannot
    hold, StoreError (transient, 503) for everything else."""
    import pyarrow as pa  # loaded already: every write builds Arrow tables

    # Exceptions of a write that say a value of the batch does not fit its column (a conversion):
    # writing the same batch again cannot succeed. Anything else (I/O, a full disk, a busy store)
    # may pass.
    conversions = (OverflowError, TypeError, ValueError, pa.ArrowInvalid, pa.ArrowTypeError)
    conversion = isinstance(exc, conversions) or type(exc).__name__ in ("ConversionException",
                                                                                 "TypeMismatchException")
    return RejectedBatch(message) if conversion else StoreError(message)


class NamedQueryReader:
    """The reader role's fixed methods, written once over a backend's ``frame(name, **params)``.

    A backend may override ``bulk`` with a faster path for large results (DuckDB: Arrow)."""

    def frame(self, name: str, **params) -> pl.DataFrame:  # pragma: no cover - every backend defines it
        raise NotImplementedError

    def bulk(self, name: str, **params) -> pl.DataFrame:
        """A named query whose result may be large (a window of rows): the backend's columnar path."""
        return self.frame(name, **params)

    def rows(self, name: str, **params) -> list[dict]:
        """A named query's rows as dicts (a backend may fetch them without building a frame)."""
        return self.frame(name, **params).to_dicts()

    def together(self, *reads: Callable[[], T]) -> list[T]:
        """Run reads that do not depend on one another; their results, in order. One after the other
        here; a backend whose reads can run on several threads at once runs them so (DuckDB)."""
        return [read() for read in reads]

    def request(self, request_id: str) -> dict | None:
        """The requests row of one request, its observers' views merged (the latest, should a sender
        have resent it); ``request_id`` may also be an alias: the upstream's own id of the answer
        (request_alias.sql). The row's ``request_id`` is the request's own."""
        rows = self.rows("request", request_id=request_id)
        if not rows:
            aliased = self.rows("request_alias", request_id=request_id)
            if aliased:
                rows = self.rows("request", request_id=aliased[0]["request_id"])
        return rows[0] if rows else None

    def requests(self, since_ns: int | None = None, until_ns: int | None = None,
                 instance_id: str | None = None, limit: int = 1000) -> pl.DataFrame:
        """Requests that started in [since, until), newest last."""
        return self.bulk("requests", since_ns=since_ns, until_ns=until_ns, instance_id=instance_id, limit=limit)

    def trace(self, trace_id: str) -> pl.DataFrame:
        """Every stored span of a trace, by start time."""
        return self.bulk("trace", trace_id=trace_id)

    def spool_seen(self, sha256: str) -> bool:
        """Whether a spool file with this hash was already ingested."""
        return self.frame("spool_seen", sha256=sha256).height > 0


class TraceWriter(Protocol):
    """The ingest side of a store (contract in the module docstring)."""

    def write(self, batch: Columns, spool: SpoolRecord | None = None,
              on_released: Callable[[], None] | None = None) -> bool:
        """Store the batch durably; False when ``spool`` was already ingested."""

    def close(self) -> None:
        """Flush and release the store."""


class TraceReader(Protocol):
    """The query side of a store (contract in the module docstring)."""

    def request(self, request_id: str) -> dict | None:
        """The ``requests`` row of one request, or None."""

    def requests(
        self, since_ns: int | None = None, until_ns: int | None = None,
        instance_id: str | None = None, limit: int = 1000,
    ) -> pl.DataFrame:
        """Requests that started in [since, until), newest last."""

    def trace(self, trace_id: str) -> pl.DataFrame:
        """Every stored span of a trace, by start time."""

    def frame(self, name: str, **params) -> pl.DataFrame:
        """A named query's result."""

    def bulk(self, name: str, **params) -> pl.DataFrame:
        """The same, for a result of many rows (a time window): the backend's columnar path."""

    def rows(self, name: str, **params) -> list[dict]:
        """The same, as a list of dicts (a few rows: what per-request verdicts read)."""

    def together(self, *reads: Callable[[], T]) -> list[T]:
        """Reads that do not depend on one another, run at once where the backend can; their results."""

    def counts(self) -> dict[str, int]:
        """Rows per table."""

    def spool_seen(self, sha256: str) -> bool:
        """Whether a spool file with this hash was already ingested."""
