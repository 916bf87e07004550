"""Retention and the disk budget of the DuckDB store (issue 45): a store beside a cluster for months
stays the size its retention makes it, and a store that reaches its budget refuses writes as
overload instead of filling the disk.

**Retention** (``--retention 30d``; the store remembers it, as a ClickHouse store keeps its TTL): a
thread of the store (``Keeper``) runs a pass at once and then every tenth of the retention (but at
least every ``MAX_INTERVAL_S`` and at most every ``MIN_INTERVAL_S``). A pass, in one transaction that
also holds the span files' lock (so no merge or compaction redefines ``spans`` meanwhile):

- deletes the rows of every timed table that started before the floor (now minus the retention;
  ``TIMED``: the time column the ClickHouse TTL uses, sql/clickhouse/ttl.sql);
- delists the span files whose newest span is older than the floor (deleted ``span_files.GRACE_S``
  later: a read planned before may still open them) and defines ``spans`` over the others with the
  floor as a filter, so a file that straddles it shows none of its older spans;
- keeps the cache verdict's index right (``REFRESH_FRONTIERS``): a packed block list records its
  first block that no earlier list of its instance and source had (``fresh_from``,
  collector/stores/frontier.py), and a cache verdict finds the first holder of a prompt's blocks
  through it. When the rows that first held a block go, the first kept row that holds it becomes
  its first holder: its ``fresh_from`` moves down to that block. Without that a prompt seen before
  the floor and again after it would be "never seen" (tests/test_store_retention_duckdb.py);
- records the floor (``retention`` table); the merge's memory of recent blocks starts again (a
  block only deleted rows held is new again for the next row that holds it).

Then a ``CHECKPOINT`` gives the deleted rows' blocks back to DuckDB, which reuses them and cuts the
file's free tail (measured: a table cycling 1M rows in and out held its file between 230 and 309
MiB). What a pass dropped is logged and shown on /healthz (``journal.retention``).

**The disk budget** (``--max-disk-bytes``): what the store uses (``usage``: the blocks of its file
DuckDB uses, its WAL, journal, span files, quarantine) is measured at most once a second and counted
up by what is journaled between; a write that would pass the budget is refused like a write to a
full disk (StoreError: 503 + Retry-After), and so is /healthz. A store at its budget first gives
back its journal file when all of it is merged (``journal.Log.retire``). It passes again by itself
once a retention pass (or the operator) frees room.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from tokentrace.collector.decoding.tables import PACKED, TABLES

log = logging.getLogger("tokentrace.collector")

#: Longest and shortest time between two passes (a tenth of the retention between them).
MAX_INTERVAL_S = 900.0
MIN_INTERVAL_S = 1.0
#: How long a measured disk usage is used before it is measured again.
USAGE_TTL_S = 1.0
#: A pass's checkpoint, refused while another connection's write transaction is open: tries, pause.
CHECKPOINT_TRIES = 20
CHECKPOINT_PAUSE_S = 0.1

_TIME_COLUMNS = ("start_ns", "t_ns", "seen_ns")


def timed_tables(stored: dict[str, str]) -> list[tuple[str, str]]:
    """(stored table, time column) of every table the normalizer writes; ``stored`` maps a table to
    where its rows are (the packed lists, ``span_rows``)."""
    found = []
    for table, columns in TABLES.items():
        columns = PACKED.get(table, columns)
        found.append((stored.get(table, table), next(c for c in _TIME_COLUMNS if c in columns)))
    return found


#: The packed block lists whose first block held by no earlier kept list changes when the lists
#: before ``$floor`` go: for each block of a deleted list (per instance and source), the first kept
#: list that holds it; its ``fresh_from`` moves down to that block when it was later (chained hashes:
#: an equal hash is at the same index). Run before the delete, in its transaction.
REFRESH_FRONTIERS = """
CREATE TEMP TABLE retention_frontiers AS
WITH gone AS (
    SELECT DISTINCT instance_id, source, unnest(hashes) AS hash
    FROM prefix_block_lists WHERE t_ns < $floor
), held AS (
    SELECT rowid AS row_id, instance_id, source, t_ns, fresh_from,
           generate_subscripts(hashes, 1) - 1 AS block_index, unnest(hashes) AS hash
    FROM prefix_block_lists WHERE t_ns >= $floor
), firsts AS (
    SELECT h.row_id, h.block_index, h.fresh_from
    FROM held h
    SEMI JOIN gone g ON g.hash = h.hash AND g.source = h.source AND g.instance_id IS NOT DISTINCT FROM h.instance_id
    QUALIFY row_number() OVER (PARTITION BY h.instance_id, h.source, h.hash ORDER BY h.t_ns, h.row_id) = 1
)
SELECT row_id, min(block_index) AS block_index
FROM firsts
WHERE fresh_from IS NULL OR block_index < fresh_from
GROUP BY row_id
"""
APPLY_FRONTIERS = """
UPDATE prefix_block_lists
SET fresh_from = f.block_index, fresh_hash = prefix_block_lists.hashes[f.block_index + 1]
FROM retention_frontiers f
WHERE prefix_block_lists.rowid = f.row_id
"""


def interval_s(retention_s: int) -> float:
    """Seconds between two passes of a retention of ``retention_s``."""
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, retention_s / 10))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _folder_size(path: Path) -> int:
    if not path.is_dir():
        return 0
    return sum(_size(entry) for entry in path.iterdir())


def files_usage(path: str) -> dict[str, int]:
    """Bytes on disk of a store's WAL and the folders beside its file (the file itself: ``usage``)."""
    return {"wal": _size(Path(path + ".wal")), "journal": _folder_size(Path(path + ".journal")),
            "span_files": _folder_size(Path(path + ".spans")), "quarantine": _folder_size(Path(path + ".quarantine")),
            "spill": _folder_size(Path(path + ".tmp"))}


class Keeper:
    """The thread that runs a store's retention passes (module docstring). ``expire(floor_ns)`` is
    the store's pass; ``retention_s()`` its retention now (0: none)."""

    def __init__(self, expire, retention_s):
        self._expire = expire
        self._retention_s = retention_s
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._wake:
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(target=self._run, name="tokentrace-retention", daemon=True)
                self._thread.start()
            self._wake.notify_all()

    def close(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        from tokentrace.threads import name_os_thread

        name_os_thread()
        while True:
            retention = self._retention_s()
            if retention:
                try:
                    self._expire(time.time_ns() - retention * 10**9)
                except Exception:
                    log.exception("a retention pass failed; the next is in %.0f s", interval_s(retention))
            with self._wake:
                if self._stopping:
                    return
                self._wake.wait(interval_s(retention) if retention else None)
                if self._stopping:
                    return
