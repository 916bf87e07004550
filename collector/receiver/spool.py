"""Spool directory ingest: OTLP files dropped into a watched directory are stored exactly once.

Accepted files: ``.pb`` (one protobuf ExportTraceServiceRequest, as the engine shim writes when the
collector is down) and ``.json`` / ``.jsonl`` (one OTLP JSON request, or JSON lines of them as the
OpenTelemetry Collector's file exporter writes). Writers should create a file under a temporary name
(leading ``.`` or a ``.tmp`` suffix) and rename it into place; on Linux a file written in place is
picked up when it is closed.

After a commit the file moves to ``ingested/``; a file that cannot be decoded moves to
``rejected/`` with ``NAME.reason.txt`` beside it and is never retried. The file's SHA-256 is
stored in the same transaction as its rows, so a crash between commit and move cannot ingest it
twice. Overload and store errors leave the file in place and retry it with backoff.

No file can jam the directory (issue 11 item 4):

- Only regular files are read: names are looked up with ``lstat`` and opened with ``O_NOFOLLOW``
  and ``O_NONBLOCK`` relative to the directory's own descriptor, so a symlink (to a file outside,
  to ``/dev/zero``), a FIFO or a device is moved to ``rejected/`` unread.
- The size is checked before reading (``--max-body-bytes``), and the read is bounded by it.
- A file still changing waits: one whose modification time is less than ``SETTLE_NS`` old, or
  whose size or modification time differ between the ``fstat`` before and after its read, is
  looked at again ``SETTLE_NS`` later, never rejected for being incomplete.
- ``ingested/`` and ``rejected/`` must be real directories inside the spool directory (checked at
  start, ``check_directory``); files move through descriptors opened then, so replacing them with
  links later writes nothing elsewhere either.
- Reason files get a safe name (at most 200 bytes of UTF-8, from the original name and a hash of
  it), and names that are not UTF-8 are recorded with backslash escapes.
- Each file is handled on its own schedule: one that waits or is retried never holds up the files
  behind it, and an unexpected error in one file is logged and leaves the thread running.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import logging
import os
import re
import stat
import threading
import time
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from tokentrace.collector.decoding.columns import Columns
from tokentrace.collector.receiver.ingest import Counters, Pipeline
from tokentrace.collector.receiver.otlp import JSON, PROTOBUF, Encoding
from tokentrace.collector.stores.store import SpoolRecord
from tokentrace.collector.stores.writer import WriteQueue
from tokentrace.errors import ConfigError, Overloaded, PayloadError, StoreError, UnsupportedMediaType
from tokentrace.threads import os_named

log = logging.getLogger("tokentrace.collector.receiver.spool")
SUFFIXES = {".pb": Encoding("protobuf", PROTOBUF), ".json": Encoding("json", JSON),
            ".jsonl": Encoding("json", JSON)}
_RETRY_SECONDS = (0.5, 1, 2, 5, 10)
#: A file modified less than this long ago is still being written: it waits (module docstring).
SETTLE_NS = 500_000_000
SUBFOLDERS = ("ingested", "rejected")
_SAFE = re.compile(r"[^A-Za-z0-9._-]")
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def check_directory(directory: str | Path) -> None:
    """Create the spool directory and its sub-folders if missing; ConfigError, in one line, when a
    sub-folder is a link or not a directory (the collector would write outside the spool)."""
    root = Path(directory).expanduser()
    try:
        for folder in (root / name for name in SUBFOLDERS):
            if os.path.lexists(folder) and not stat.S_ISDIR(os.lstat(folder).st_mode):
                raise ConfigError(f"--spool-dir: {folder} must be a directory inside the spool directory, "
                                  f"found a link or another kind of file; move it away")
        root.mkdir(parents=True, exist_ok=True)
        for name in SUBFOLDERS:
            with contextlib.suppress(FileExistsError):
                (root / name).mkdir()
    except OSError as exc:
        raise ConfigError(f"--spool-dir: cannot use {root}: {exc}") from None


def safe_name(name: str, limit: int = 200) -> str:
    """A name for ``rejected/``: the original when it is short, printable UTF-8; otherwise a
    readable prefix, a hash of the original bytes and the suffix, in at most ``limit`` bytes."""
    raw = os.fsencode(name)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and len(raw) <= limit and text.isprintable():
        return text
    suffix = _SAFE.sub("_", Path(os.fsdecode(raw)).suffix)[:16]
    prefix = _SAFE.sub("_", raw.decode("utf-8", "replace"))[: limit - 40 - len(suffix)]
    return f"{prefix}-{hashlib.sha256(raw).hexdigest()[:16]}{suffix}"


def shown(name: str) -> str:
    """A file name as text that any store and log can hold (non-UTF-8 bytes escaped)."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")[:255]


def is_candidate(path: Path) -> bool:
    """Whether a file is a finished OTLP file to ingest (not temporary, known suffix)."""
    name = path.name
    return not name.startswith(".") and not name.endswith(".tmp") and path.suffix in SUFFIXES


class _Events(FileSystemEventHandler):
    def __init__(self, ingester: SpoolIngester, react_to_created: bool):
        self.ingester = ingester
        self.react_to_created = react_to_created

    def on_moved(self, event: FileSystemEvent) -> None:
        self.ingester.offer(Path(os.fsdecode(event.dest_path)))

    def on_closed(self, event: FileSystemEvent) -> None:
        self.ingester.offer(Path(os.fsdecode(event.src_path)))

    def on_created(self, event: FileSystemEvent) -> None:
        if self.react_to_created:
            self.ingester.offer(Path(os.fsdecode(event.src_path)))


class SpoolIngester:
    """Watches one directory and feeds its files through the pipeline to the write queue."""

    def __init__(self, directory: str | Path, pipeline: Pipeline, write_queue: WriteQueue, counters: Counters):
        check_directory(directory)
        self.directory = Path(directory).expanduser().resolve()
        self.ingested_dir = self.directory / "ingested"
        self.rejected_dir = self.directory / "rejected"
        self._fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._folders = {name: os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                       dir_fd=self._fd) for name in SUBFOLDERS}
        self.pipeline = pipeline
        self.queue = write_queue
        self.counters = counters
        self._due: list[tuple[float, int, str]] = []  # (when, order, name): a heap
        self._order = 0
        self._pending: set[str] = set()
        self._attempts: dict[str, int] = {}
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._stats = {"ingested": 0, "duplicates": 0, "rejected": 0, "retries": 0, "waiting": 0}
        self._observer = Observer()
        # inotify reports close-after-write; elsewhere "created" is the only signal we get.
        closes = type(self._observer).__name__ == "InotifyObserver"
        self._observer.schedule(_Events(self, react_to_created=not closes), str(self.directory), recursive=False)
        self._thread = threading.Thread(target=os_named(self._run), name="tokentrace-spool", daemon=True)

    def start(self) -> None:
        """Watch first, then offer what is already there, so nothing falls between the two."""
        self._observer.start()
        self._thread.start()
        for name in sorted(os.listdir(self._fd)):
            self.offer(self.directory / name)

    def stop(self) -> None:
        """Stop watching; files not yet ingested stay for the next start."""
        self._stop.set()
        self._observer.stop()
        with self._wake:
            self._wake.notify_all()
        self._thread.join(30)
        self._observer.join(5)
        for fd in (*self._folders.values(), self._fd):
            os.close(fd)

    def offer(self, path: Path) -> None:
        """Queue a path for ingest unless it is already queued or not a candidate."""
        if path.parent != self.directory or not is_candidate(path):
            return
        with self._wake:
            if path.name in self._pending:
                return
            self._pending.add(path.name)
        self._schedule(path.name, 0.0)

    def snapshot(self) -> dict:
        """Counts for /healthz."""
        with self._wake:
            return {"directory": str(self.directory), "pending": len(self._pending), **self._stats}

    def _schedule(self, name: str, delay: float) -> None:
        with self._wake:
            self._order += 1
            heapq.heappush(self._due, (time.monotonic() + delay, self._order, name))
            self._wake.notify()

    def _next(self) -> str | None:
        with self._wake:
            while not self._stop.is_set():
                if self._due and self._due[0][0] <= time.monotonic():
                    return heapq.heappop(self._due)[2]
                self._wake.wait(None if not self._due else self._due[0][0] - time.monotonic())
        return None

    def _run(self) -> None:
        while (name := self._next()) is not None:
            try:
                delay = self._ingest(name)
            except Exception:  # one file must never stop the thread or the files behind it
                log.exception("spool file %s could not be handled; it is left in place", shown(name))
                delay = None
            if delay is None:
                with self._wake:
                    self._pending.discard(name)
                    self._attempts.pop(name, None)
            else:
                self._schedule(name, delay)

    def _ingest(self, name: str) -> float | None:
        """Handle one file; a delay in seconds means 'look again then', None means done."""
        try:
            before = os.lstat(name, dir_fd=self._fd)
        except FileNotFoundError:
            return None  # moved away already (a duplicate event)
        if not stat.S_ISREG(before.st_mode):
            self._reject(name, "not a regular file (a link, FIFO, device or directory): only regular files "
                               "are read")
            return None
        limit = self.pipeline.max_body_bytes
        if before.st_size > limit:
            self.counters.reject("too_large")
            self._reject(name, f"file of {before.st_size} bytes is over the limit of {limit} bytes")
            return None
        age = time.time_ns() - before.st_mtime_ns
        if age < SETTLE_NS:
            return self._wait(name, (SETTLE_NS - age) / 1e9)
        data = self._read(name, before, limit)
        if data is None:
            return self._wait(name, SETTLE_NS / 1e9)
        try:
            batch = self._decode(name, data)
            written = self.queue.submit(batch, SpoolRecord.of(data, shown(name))).result()
        except (PayloadError, UnsupportedMediaType) as exc:
            self._reject(name, str(exc))
            return None
        except (Overloaded, StoreError) as exc:
            log.warning("spool file %s not ingested yet: %s", shown(name), exc)
            self._stats["retries"] += 1
            attempt = self._attempts[name] = self._attempts.get(name, 0) + 1
            return _RETRY_SECONDS[min(attempt - 1, len(_RETRY_SECONDS) - 1)]
        self._stats["ingested" if written else "duplicates"] += 1
        self._move(name, "ingested", name)
        return None

    def _wait(self, name: str, delay: float) -> float:
        self._stats["waiting"] += 1
        return max(delay, 0.05)

    def _read(self, name: str, before: os.stat_result, limit: int) -> bytes | None:
        """The file's bytes, or None when it changed meanwhile (it is read again later)."""
        fd = os.open(name, _OPEN_FLAGS, dir_fd=self._fd)
        try:
            opened = os.fstat(fd)
            if not stat.S_ISREG(opened.st_mode) or (opened.st_ino, opened.st_dev) != (before.st_ino, before.st_dev):
                return None  # replaced between lstat and open
            chunks, size = [], 0
            while size <= limit:
                chunk = os.read(fd, min(1 << 20, limit + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            after = os.fstat(fd)
        finally:
            os.close(fd)
        unchanged = size == after.st_size == before.st_size and after.st_mtime_ns == before.st_mtime_ns
        return b"".join(chunks) if unchanged else None

    def _decode(self, name: str, data: bytes) -> Columns:
        if len(data) > self.pipeline.max_body_bytes:
            self.counters.reject("too_large")
            raise PayloadError(f"file of {len(data)} bytes is over the limit of {self.pipeline.max_body_bytes}")
        encoding = SUFFIXES[Path(name).suffix]
        if encoding.name == "protobuf":
            return self.pipeline.batch(data, encoding)
        parts = []
        for number, document in enumerate(_json_documents(data), start=1):
            try:
                parts.append(self.pipeline.batch(document, encoding))
            except PayloadError as exc:
                raise PayloadError(f"line {number}: {exc}") from exc
        batch = Columns.concat(parts) if parts else Columns()
        if not batch.spans:
            raise PayloadError("the file holds no span")
        return batch

    def _reject(self, name: str, reason: str) -> None:
        self._stats["rejected"] += 1
        target = self._move(name, "rejected", safe_name(name))
        if target is not None:
            text = f"{shown(name)}: {reason}\n".encode("utf-8", "backslashreplace")
            fd = os.open(target + ".reason.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644, dir_fd=self._folders["rejected"])
            try:
                os.write(fd, text)
            finally:
                os.close(fd)
        log.warning("spool file %s rejected: %s", shown(name), reason)

    def _move(self, name: str, folder: str, target: str) -> str | None:
        """Move ``name`` into a sub-folder (through its descriptor); the name it got, or None."""
        folder_fd = self._folders[folder]
        if _exists(target, folder_fd) or _exists(target + ".reason.txt", folder_fd):
            stem, dot, suffix = target.rpartition(".")
            target = f"{stem}.{time.time_ns()}.{suffix}" if dot else f"{target}.{time.time_ns()}"
        try:
            os.rename(name, target, src_dir_fd=self._fd, dst_dir_fd=folder_fd)
        except FileNotFoundError:  # another event moved it first
            return None
        return target


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def _json_documents(data: bytes) -> list[bytes]:
    """One OTLP JSON document, or JSON lines of them (the OpenTelemetry Collector file exporter)."""
    try:
        json.loads(data)
        return [data]
    except (json.JSONDecodeError, UnicodeDecodeError):
        lines = [line for line in data.splitlines() if line.strip()]
        return lines if len(lines) > 1 else [data]
