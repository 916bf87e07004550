"""The DuckDB store's write-ahead journal: a batch is acknowledged once it is on disk in an
append-only log beside the store file, and appended to the typed tables behind that, in large
groups (issue 17).

Why: a DuckDB commit of ~12 typed tables cost 10-15 ms whatever its size (each table's append
and commit work is per table and column; docs/benchmarks.md), so with a few senders each waiting
for its acknowledgement the collector could not commit more than ~50k engine spans/s however fast
it parsed. Now the acknowledged write is one append and one ``fdatasync`` of the batch's columns
(collector/decoding/columns.py) for every batch the writer thread took at once, and a merge thread appends
everything journaled since its last merge to the tables in one DuckDB transaction that also
records the last sequence number it holds (``journal_state``). A batch is therefore in the tables
exactly once: after a crash the store appends the records after that number (``records_after``)
before it takes new writes, and a record cut short by the crash was never acknowledged (its
checksum fails; the log is cut there).

Visibility: readers of the store first wait until everything journaled when they were called is
merged (``settle``), so a caller reads its own writes as before; the wait is at most about one
merge, which such a reader starts at once if the merge thread is still gathering batches for it
(``GATHER_*``: larger merges cost less a span). A patient reader (``settle(urgent=False)``: the
/metrics verdict thread) waits for the merge thread's own pace instead. A read-only open
(``tokentrace analyze --db``) cannot merge: it reads the tables without what a killed collector
left in its journal, which the next collector to open the store appends.

Memory: unmerged batches are held in memory until merged, up to ``max_bytes`` of columns (the
collector counts them against its byte budget, collector/receiver/budget.py, and gives the store three
quarters of it). Past that bound a write waits for the merge thread and then refuses (Overloaded:
503 + Retry-After), so a slow disk or ingest faster than the merge slows the senders instead of
growing the collector; except while a merge is held up (running ``PAUSE_S`` or longer): a batch
journaled then is spilled, its columns written to a file beside the log (``SEQ.spill``, Arrow
IPC, not synced: a crash loses nothing, the log holds the batch) and dropped from memory, the
request's bytes released at once; the merge maps the file back when it reaches the batch. Why
(issue 17, twentieth round): DuckDB checkpoints inside a merge's ``COMMIT`` (3.5 s at its 256 MB
WAL threshold under engine-shaped load); held only in memory, the batches journaled meanwhile
filled the budget and the senders were refused with a 1-s Retry-After, 12 of a run's 16 refusals.
Spilled bytes are bounded too (``max_spilled_bytes``); a spill that fails (a full disk) leaves
its batch in memory and stops spilling until a merge passes.

Files: ``STORE.journal/SEQ.log``, a new one past ``SEGMENT_BYTES``; a file whose records are all
merged is deleted. Record: magic, sequence number, length and CRC-32 of the payload (little
endian), then the payload.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

from tokentrace.collector.decoding.columns import Columns
from tokentrace.collector.stores.store import SpoolRecord
from tokentrace.errors import Overloaded, StoreError
from tokentrace.threads import os_named

log = logging.getLogger("tokentrace.collector")
#: Unmerged bytes held in memory past which writes wait, then refuse, or while a merge is held up are
#: spilled to disk (the collector gives the store three quarters of its byte budget: ``hold_unmerged``).
MAX_UNMERGED_BYTES = 192 << 20
#: Seconds a merge runs before it counts as held up (DuckDB's checkpoint: 3.5 s under load; a merge
#: of 100-200k engine spans takes 0.5-1.5 s): only then are batches past ``max_bytes`` spilled.
#: Without the condition every batch past the bound was spilled whenever ingest outran the merge,
#: which cost 4 % more CPU a span (spilling and reading back 2.1 us a spilled span) for no more
#: spans into the tables (issue 17, twentieth round).
PAUSE_S = 1.0
#: Unmerged bytes spilled to disk past which writes wait, then refuse: about 600k engine spans, 6 s
#: of ingest at 100k spans/s (a checkpoint's pause is 3-4 s). It also bounds how far the tables may
#: trail the acknowledgements, which a reader waits for (``settle``).
MAX_SPILLED_BYTES = 512 << 20
#: Most spans appended in one merge transaction (a long stall is merged in several).
MERGE_SPANS = 200_000
#: A merge waits for this many spans ...
GATHER_SPANS = 120_000
#: ... or this share of the bound of unmerged bytes held in memory ...
GATHER_SHARE = 1 / 3
#: ... or until its oldest batch was journaled this many seconds ago, whichever comes first; a
#: reader waiting for the merge (``settle``) or a stop starts it at once. Merges of ~70k engine spans
#: instead of the ~28k a merge thread that merged whatever was there gathered cost 9.3 instead of
#: 12.8-13.2 us a span of merge CPU (bench/merge.py): DuckDB's cost per merge (an insert per table,
#: the commit's per-table work, the tables' last row groups) is paid less often.
GATHER_S = 0.5
#: Seconds a reader waits for the merge before it reads what is merged.
SETTLE_TIMEOUT_S = 10.0
#: Seconds a write waits for room before it refuses.
ROOM_TIMEOUT_S = 2.0
#: Size past which the log starts a new file.
SEGMENT_BYTES = 64 << 20
#: Pauses between a failed merge and its retries (the last one repeats), unless ``retry_now``
#: ends one early.
_RETRY_S = (0.1, 0.5, 1.0, 2.0, 5.0)
#: Failures in a row of a merge of one batch alone after which the store may set it aside
#: (``quarantine``): a batch its tables refuse must not stop every batch after it (issue 45).
QUARANTINE_AFTER = 5
_HEADER = struct.Struct("<IQII")  # magic, sequence number, payload length, CRC-32 of the payload
_MAGIC = 0x544A524E


@dataclass
class Entry:
    """One journaled batch: its sequence number, its rows and their size."""

    seq: int
    columns: Columns | None  #: None while spilled (``load``)
    nbytes: int
    spool: SpoolRecord | None = None  #: the spool file it came from (recorded with its rows)
    #: called once its rows are in the tables or its columns spilled to disk (held no more)
    on_released: Callable[[], None] | None = None
    journaled_at: float = 0.0  #: time.monotonic() when it was journaled
    spans: int = -1  #: its spans (kept while spilled)
    spilled: Path | None = None  #: the file holding its tables while they are out of memory
    _spilled_tables: list[tuple[str, int, int]] = field(default_factory=list, repr=False)  #: name, start, end

    def __post_init__(self) -> None:
        if self.spans < 0:
            self.spans = self.columns.spans

    def load(self) -> Columns:
        """Its columns: those in memory, or its tables mapped from its spill file (``_spill``:
        their buffers point into it) with its span count, which is what a merge reads."""
        if self.spilled is None:
            return self.columns
        mapped = pa.memory_map(str(self.spilled))
        tables = {}
        for name, start, end in self._spilled_tables:
            tables[name] = ipc.open_stream(mapped.read_at(end - start, start)).read_all()
        return Columns(tables, spans=self.spans)

    def release(self) -> None:
        """Call ``on_released`` once (each caller runs while only its thread holds the entry)."""
        call, self.on_released = self.on_released, None
        if call is not None:
            call()


class Log:
    """The append-only files of the journal (module docstring)."""

    def __init__(self, folder: Path, read_only: bool = False):
        self.folder = folder
        #: a ``tokentrace store check``'s: nothing is created, deleted or cut (``torn`` says what would be)
        self.read_only = read_only
        #: (file, start, end) of each record cut short at the end of the newest file that a read-only
        #: log left in place (a writer cuts it: ``records_after``)
        self.torn: list[tuple[Path, int, int]] = []
        if not read_only:
            folder.mkdir(exist_ok=True)
            for path in self.spills():  # columns a stopped collector spilled: its log holds them
                _unlink(path)
        self._file = None
        self._size = 0
        self._last = 0  #: the sequence number of the newest record appended by this open
        self._broken = False

    def spills(self) -> list[Path]:
        """The spill files in the folder (``Journal._spill``): a stopped collector's, deleted at the next open."""
        return sorted(self.folder.glob("*.spill"))

    def _segments(self) -> list[tuple[int, Path]]:
        found = []
        for path in self.folder.glob("*.log"):
            if path.stem.isdigit():
                found.append((int(path.stem), path))
        return sorted(found)

    def records_after(self, seq: int, damaged: Callable[[Damage], None] | None = None,
                      expected: int = 0) -> Iterator[tuple[int, memoryview]]:
        """The intact records with a sequence number above ``seq``, in order.

        A record cut short at the very end of the newest file is a crash while writing it (never
        acknowledged: the fdatasync that would have made it so did not return): the file is cut
        there (a ``read_only`` log only records it in ``torn``). Anything else that does not read
        back (a checksum that fails, a header that makes no sense, a file that ends inside a record
        or before the next file begins, sequence numbers that skip) is damage: it is given to
        ``damaged`` with its byte range and the sequence numbers it held (from the records around
        it, and ``expected``, the highest number known to have been journaled), and every intact
        record after it is kept (issue 45)."""
        segments = self._segments()
        previous = None  #: the number of the last record read back or known lost
        report = damaged or (lambda _damage: None)
        for index, (first, path) in enumerate(segments):
            data = path.read_bytes()
            view, newest = memoryview(data), index == len(segments) - 1
            if previous is not None and first > previous + 1:
                report(Damage(path, 0, 0, previous + 1, first - 1,
                              f"journal records missing between {segments[index - 1][1].name} and this file "
                              f"(a file deleted or cut short)"))
            if previous is None or first > previous + 1:
                previous = first - 1  # a file is named after its first record
            for kind, at, end, number in _scan(data):
                if kind == "record":
                    if number > previous + 1:
                        report(Damage(path, at, at, previous + 1, number - 1,
                                      "journal records missing (sequence numbers skip)"))
                    previous = number
                    if number > seq:
                        yield number, view[at + _HEADER.size:end]
                elif kind == "torn" and newest:
                    if self.read_only:
                        self.torn.append((path, at, end))
                    else:
                        self._cut(path, at)
                else:
                    high = _next_number(data, end)
                    high = (high - 1) if high is not None else None if newest else segments[index + 1][0] - 1
                    report(Damage(path, at, end, previous + 1, high, _why(data, at, end)))
                    if high is not None:
                        previous = high
        if expected > max(seq, previous or 0):
            where = segments[-1][1] if segments else self.folder
            report(Damage(where, -1, -1, max(seq, previous or 0) + 1, expected,
                          "journal records missing at its end (the newest file cut short or deleted)"))

    def record(self, seq: int) -> bytes | None:
        """The payload of record ``seq`` as it is in the log (read only; None when absent)."""
        for first, path in reversed(self._segments()):
            if first > seq:
                continue
            data = path.read_bytes()
            for kind, at, end, number in _scan(data):
                if kind == "record" and number == seq:
                    return data[at + _HEADER.size:end]
            return None
        return None

    def _cut(self, path: Path, at: int) -> None:
        log.warning("journal %s ends in a record cut short at byte %d (a crash while writing it): dropped",
                    path, at)
        with open(path, "r+b") as handle:
            handle.truncate(at)
            os.fsync(handle.fileno())

    def append(self, seq: int, payload: list[bytes]) -> None:
        """Write one record (its payload in pieces) and make it durable (one fdatasync)."""
        if self._file is None or self._size >= SEGMENT_BYTES:
            self._open(seq)
        if self._broken:
            raise StoreError(f"the journal {self.folder} could not be repaired after a failed write; restart "
                             f"the collector (it appends every acknowledged batch)")
        crc, length = 0, 0
        for piece in payload:
            crc, length = zlib.crc32(piece, crc), length + len(piece)
        chunks = [_HEADER.pack(_MAGIC, seq, length, crc), *payload]
        try:
            written = os.writev(self._file, chunks)
            while written < _HEADER.size + length:  # a short write: the rest, from where it stopped
                written += os.write(self._file, b"".join(chunks)[written:])
            os.fdatasync(self._file)
        except OSError:
            # A record cut short in the middle of the log would end it there at the next start,
            # hiding the acknowledged records after it: take it back, or take no more.
            try:
                os.ftruncate(self._file, self._size)
            except OSError:
                self._broken = True
            raise
        self._size += _HEADER.size + length
        self._last = seq

    def retire(self, merged: int) -> int:
        """Delete the file being appended to when every record in it is merged (``merged``: the
        last merged sequence number), so that the next record starts a new one: a store at its disk
        budget gives back a segment's merged bytes without waiting for ``SEGMENT_BYTES``. The
        appending thread's (no record is appended meanwhile); the bytes given back."""
        if self._file is None or self._last > merged:
            return 0
        segments = self._segments()
        size = self._size
        os.close(self._file)
        self._file, self._size = None, 0
        if segments:
            segments[-1][1].unlink(missing_ok=True)
        return size

    def _open(self, first_seq: int) -> None:
        if self._file is not None:
            os.close(self._file)
        self._file = os.open(self.folder / f"{first_seq:020d}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._file).st_size
        directory = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(directory)  # the new file's name is durable too
        finally:
            os.close(directory)

    def drop_through(self, seq: int) -> None:
        """Delete the files whose records all have sequence numbers up to ``seq``."""
        segments = self._segments()
        for (_, path), (next_first, _) in itertools.pairwise(segments):
            if next_first <= seq + 1:
                path.unlink(missing_ok=True)

    def close(self, merged_all: bool) -> None:
        """Close the file; when everything is merged, the log is removed."""
        if self._file is not None:
            os.close(self._file)
            self._file = None
        if merged_all:
            for _, path in self._segments():
                path.unlink()
            if not any(self.folder.iterdir()):
                self.folder.rmdir()


class Journal:
    """Unmerged journal entries and the thread that merges them (module docstring).

    ``merge(entries)`` is the store's: it appends the entries' rows and records the last sequence
    number in one transaction, raising on failure (the entries are then merged again later)."""

    def __init__(self, merge: Callable[[list[Entry]], None], log_file: Log, max_bytes: int = MAX_UNMERGED_BYTES,
                 max_spilled_bytes: int = MAX_SPILLED_BYTES,
                 quarantine: Callable[[Entry, Exception], bool] | None = None):
        self._merge, self.log = merge, log_file
        #: the store's: set aside one batch its tables refuse (True), or not (False: a condition that
        #: passes, such as a full disk); the batch then counts as merged (``QUARANTINE_AFTER``)
        self._quarantine = quarantine
        self._alone = 0  #: merges to take one batch at a time, to find the one at fault
        self.max_bytes = max_bytes  #: unmerged bytes held in memory past which writes wait or are spilled
        self.max_spilled_bytes = max_spilled_bytes  #: spilled bytes past which writes wait, then refuse
        self._pending: deque[Entry] = deque()
        self._bytes = 0  #: unmerged bytes, in memory or spilled
        self._spilled = 0  #: of which spilled
        self._merge_began: float | None = None  #: time.monotonic() when the running merge began
        self._spill_failed = False  #: a spill failed since the last merge
        self.spills = 0  #: batches spilled
        self._spans = 0  #: spans of the pending entries
        self._readers = 0  #: readers waiting in settle: the merge starts without gathering
        self._cond = threading.Condition()
        self.journaled = 0  #: highest sequence number journaled
        self.merged = 0  #: highest sequence number merged
        self.error: str | None = None  #: why the latest merge failed, until one succeeds
        self.merges = 0  #: merges done
        self.merged_spans = 0  #: spans they appended
        self.last_merge_s = 0.0  #: how long the latest merge took
        self._retry_now = False  #: a failed merge's pause ends early (``retry_now``)
        self._stopping = False
        self._thread = threading.Thread(target=os_named(self._run), name="tokentrace-merge", daemon=True)

    def start(self, after: int, pending: list[Entry] | tuple = ()) -> None:
        """Start merging; sequence numbers up to ``after`` are already in the tables, and ``pending``
        (journaled before this start, numbered after ``after``, in order) are merged first."""
        self.journaled = self.merged = after
        for entry in pending:
            self._hold(entry)
        self._thread.start()

    # --- the writer's side ------------------------------------------------------------------------
    def _held_up_at(self) -> float | None:
        """When the running merge counts as held up (``PAUSE_S`` after it began: a checkpoint), so
        that batches may be spilled; None while no merge runs or spills fail."""
        return None if self._merge_began is None or self._spill_failed else self._merge_began + PAUSE_S

    def _held_up(self) -> bool:
        at = self._held_up_at()
        return at is not None and time.monotonic() >= at

    def _has_room(self) -> bool:
        return ((self._bytes - self._spilled <= self.max_bytes or self._held_up())
                and self._spilled <= self.max_spilled_bytes)

    def make_room(self, timeout: float = ROOM_TIMEOUT_S) -> None:
        """Wait while the unmerged bytes in memory (unless a held-up merge lets them be spilled) or
        on disk are over their bounds; Overloaded when they stay over them."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (self._has_room() or self._stopping):
                now = time.monotonic()
                if now >= deadline:
                    raise Overloaded(f"the store has {self._bytes >> 20} MiB of acknowledged batches still to "
                                     f"append to its tables; retry later", retry_after=1)
                held_up_at = self._held_up_at()
                wake = min(deadline, held_up_at) if held_up_at is not None and now < held_up_at else deadline
                self._cond.wait(max(0.001, wake - now))

    def add(self, entry: Entry, payload: list[bytes]) -> None:
        """Journal a batch durably (it may be acknowledged when this returns), spill its columns if
        memory holds as many unmerged bytes as it may while a merge is held up, then merge it."""
        self.log.append(entry.seq, payload)
        entry.journaled_at = time.monotonic()
        with self._cond:
            spill = self._bytes - self._spilled + entry.nbytes > self.max_bytes and self._held_up()
        if spill:
            self._spill(entry)
        if entry.spilled is not None:
            entry.release()  # before the merge thread can see it: its release after the merge finds nothing
        with self._cond:
            self._hold(entry)
            self._cond.notify_all()

    def _spill(self, entry: Entry) -> None:
        """Write the entry's columns beside the log and drop them from memory; a failure (a full
        disk) leaves them in memory, where they count against ``max_bytes`` (``make_room``)."""
        path = self.log.folder / f"{entry.seq:020d}.spill"
        try:
            # One Arrow IPC stream a table, written straight to the file (no copy in memory); where
            # each is stays with the entry. Not synced: the journal holds the batch.
            with pa.OSFile(str(path), "wb") as sink:
                for name, rows in entry.columns.tables.items():
                    start = sink.tell()
                    with ipc.new_stream(sink, rows.schema) as writer:
                        writer.write_table(rows)
                    entry._spilled_tables.append((name, start, sink.tell()))
        except OSError as exc:
            with self._cond:
                self._spill_failed = True  # no more spills until a merge passes (the disk may have room then)
            entry._spilled_tables.clear()
            _unlink(path)
            log.warning("spilling journaled batch %d to %s failed (%s): it stays in memory", entry.seq, path, exc)
            return
        entry.spilled, entry.columns = path, None

    def retry_now(self) -> None:
        """End a failed merge's pause: the store has seen its disk refuse a write for lack of room
        and then take one, so a merge that failed for room may pass now (its pause is up to 5 s,
        during which /healthz says the store cannot append). Nothing waits when no merge failed."""
        with self._cond:
            self._retry_now = True
            self._cond.notify_all()

    def _hold(self, entry: Entry) -> None:
        """Queue a journaled entry for merging (under the condition's lock, or before the thread starts)."""
        self._pending.append(entry)
        self._bytes += entry.nbytes
        if entry.spilled is not None:
            self._spilled += entry.nbytes
            self.spills += 1
        self._spans += entry.spans
        self.journaled = entry.seq

    def unmerged(self) -> list[Entry]:
        """The entries not merged yet (a copy)."""
        with self._cond:
            return list(self._pending)

    # --- readers ----------------------------------------------------------------------------------
    def settle(self, timeout: float = SETTLE_TIMEOUT_S, urgent: bool = True) -> bool:
        """Wait until everything journaled before this call is merged; False on timeout (and at once
        while merges are failing: a reader then reads what is merged). An ``urgent`` reader starts
        a merge that is gathering batches; another waits for it (at most ``GATHER_S`` more)."""
        with self._cond:
            target = self.journaled
            self._readers += urgent
            self._cond.notify_all()
            try:
                return self._cond.wait_for(
                    lambda: self.merged >= target or self._stopping or self.error is not None, timeout)
            finally:
                self._readers -= urgent

    def snapshot(self) -> dict:
        """A JSON-ready view for /healthz."""
        with self._cond:
            return {"unmerged_batches": len(self._pending), "unmerged_bytes": self._bytes,
                    "spilled_bytes": self._spilled, "spills": self.spills,
                    "merges": self.merges, "merged_spans": self.merged_spans,
                    "last_merge_ms": round(self.last_merge_s * 1000, 1), "last_merge_error": self.error}

    # --- the merge thread -------------------------------------------------------------------------
    def close(self, timeout: float = 60.0) -> None:
        """Merge what is journaled, then stop the thread and close the log."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._cond:
            merged_all = not self._pending
            for entry in self._pending:  # the log holds them: the next start reads them from it
                _unlink(entry.spilled)
        self.log.close(merged_all)

    def _gathered(self) -> bool:
        """Whether the pending entries make a merge now (constants above)."""
        return (self._stopping or self._readers > 0 or self._spans >= GATHER_SPANS
                or self._bytes >= self.max_bytes * GATHER_SHARE
                or time.monotonic() - self._pending[0].journaled_at >= GATHER_S)

    def _take(self) -> list[Entry]:
        with self._cond:
            self._cond.wait_for(lambda: self._pending or self._stopping)
            while self._pending and not self._gathered():
                self._cond.wait(max(0.0, self._pending[0].journaled_at + GATHER_S - time.monotonic()))
            taken, spans = [], 0
            for entry in self._pending:
                if taken and (spans + entry.spans > MERGE_SPANS or self._alone > 0):
                    break
                taken.append(entry)
                spans += entry.spans
            return taken

    def _run(self) -> None:
        failures = alone_failures = 0
        while True:
            entries = self._take()
            if not entries:
                return  # stopping, and nothing left
            began = time.monotonic()
            with self._cond:
                self._merge_began = began
                self._cond.notify_all()  # a write waiting for room learns when the merge counts as held up
            try:
                self._merge(entries)
            except Exception as exc:  # the entries stay journaled and pending: merged again later
                log.exception("appending %d journaled batches to the tables failed; retrying", len(entries))
                if len(entries) > 1:  # merged one at a time from now until one passes: which one fails?
                    self._alone, alone_failures = len(entries), 0
                else:
                    alone_failures += 1
                    if alone_failures >= QUARANTINE_AFTER and self._quarantine is not None \
                            and self._quarantine(entries[0], exc):
                        failures = alone_failures = 0
                        self._alone = max(0, self._alone - 1)
                        self._done(entries, began, set_aside=True)
                        continue
                with self._cond:
                    self.error = str(exc)
                    self._merge_began = None  # a failing merge is not held up: nothing is spilled for it
                    self._cond.notify_all()
                    if self._stopping and failures >= len(_RETRY_S):
                        return  # stopping: they stay in the journal for the next start
                    self._retry_now = False  # only what happens after this failure ends its pause
                    self._cond.wait_for(lambda: self._retry_now, _RETRY_S[min(failures, len(_RETRY_S) - 1)])
                failures += 1
                continue
            failures, alone_failures, self._alone = 0, 0, max(0, self._alone - 1)
            self._done(entries, began)

    def _done(self, entries: list[Entry], began: float, set_aside: bool = False) -> None:
        """``entries`` are in the tables (or ``set_aside``: quarantined by the store): drop them from
        memory and the log."""
        with self._cond:
            for _ in entries:
                merged = self._pending.popleft()
                self._bytes -= merged.nbytes
                self._spans -= merged.spans
                if merged.spilled is not None:
                    self._spilled -= merged.nbytes
            self.merged = entries[-1].seq
            self.error = None
            self._merge_began, self._spill_failed = None, False
            if not set_aside:
                self.merges += 1
                self.merged_spans += sum(entry.spans for entry in entries)
                self.last_merge_s = time.monotonic() - began
            self._cond.notify_all()
        for entry in entries:
            entry.release()
            _unlink(entry.spilled)
        try:
            self.log.drop_through(entries[-1].seq)
        except OSError:  # a file that stays is read past at the next start: nothing is lost
            log.exception("deleting merged journal files failed")


@dataclass(frozen=True)
class Damage:
    """Bytes of the journal that do not read back as records, and the records they held."""

    path: Path  #: the journal file
    start: int  #: byte range in it (``start`` == ``end``: records missing, no bytes; -1: at its end)
    end: int
    first_seq: int | None  #: sequence numbers of the records lost (None: not known)
    last_seq: int | None
    why: str


def _valid_at(data: bytes, at: int) -> int | None:
    """The end of an intact record starting at byte ``at`` (magic, length within the file, CRC), else None."""
    if at + _HEADER.size > len(data):
        return None
    magic, _, length, crc = _HEADER.unpack_from(data, at)
    end = at + _HEADER.size + length
    if magic != _MAGIC or end > len(data) or zlib.crc32(memoryview(data)[at + _HEADER.size:end]) != crc:
        return None
    return end


def _why(data: bytes, at: int, end: int) -> str:
    """What is wrong with the bytes from ``at`` to ``end`` that are not an intact record."""
    if end - at < _HEADER.size:
        return "the file ends inside a record header"
    magic, _, length, _ = _HEADER.unpack_from(data, at)
    if magic != _MAGIC:
        return "bytes that are not a record (its header is damaged)"
    if at + _HEADER.size + length > end:
        return "the file ends inside a record, or its length is damaged"
    return "a record whose checksum fails"


def _next_number(data: bytes, at: int) -> int | None:
    """The sequence number of the intact record at ``at``, if one starts there."""
    return _HEADER.unpack_from(data, at)[1] if _valid_at(data, at) is not None else None


def _scan(data: bytes) -> Iterator[tuple[str, int, int, int | None]]:
    """What a journal file holds, in order: ("record", start, end, seq) for each intact record,
    ("damaged", start, end, None) for bytes between intact records that are not one (the next
    intact record is found by its magic number and checksum), and ("torn", start, len, None) for
    bytes after the last intact record that never become one: a crash's tail, or damage that ends
    the file (its caller tells which)."""
    at, magic = 0, _HEADER.pack(_MAGIC, 0, 0, 0)[:4]
    while at < len(data):
        end = _valid_at(data, at)
        if end is not None:
            yield "record", at, end, _HEADER.unpack_from(data, at)[1]
            at = end
            continue
        search = at + 1
        while (found := data.find(magic, search)) >= 0 and _valid_at(data, found) is None:
            search = found + 1
        if found < 0:
            yield "torn", at, len(data), None
            return
        yield "damaged", at, found, None
        at = found


def _unlink(path: Path | None) -> None:
    """Delete a spill file (None: nothing); one left behind is deleted at the next start."""
    if path is not None:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            log.exception("deleting the spill file %s failed", path)
