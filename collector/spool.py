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
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from tokentrace.collector.ingest import Counters, Pipeline
from tokentrace.collector.normalize import Batch
from tokentrace.collector.otlp import JSON, PROTOBUF, Encoding
from tokentrace.collector.store import SpoolRecord
from tokentrace.collector.writer import WriteQueue
from tokentrace.errors import Overloaded, PayloadError, StoreError, UnsupportedMediaType

log = logging.getLogger("tokentrace.collector.spool")
SUFFIXES = {".pb": Encoding("protobuf", PROTOBUF), ".json": Encoding("json", JSON),
            ".jsonl": Encoding("json", JSON)}
_RETRY_SECONDS = (0.5, 1, 2, 5, 10)


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
        self.directory = Path(directory).expanduser().resolve()
        self.ingested_dir = self.directory / "ingested"
        self.rejected_dir = self.directory / "rejected"
        for folder in (self.directory, self.ingested_dir, self.rejected_dir):
            folder.mkdir(parents=True, exist_ok=True)
        self.pipeline = pipeline
        self.queue = write_queue
        self.counters = counters
        self._work: queue.Queue[Path | None] = queue.Queue()
        self._pending: set[Path] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stats = {"ingested": 0, "duplicates": 0, "rejected": 0, "retries": 0}
        self._observer = Observer()
        # inotify reports close-after-write; elsewhere "created" is the only signal we get.
        closes = type(self._observer).__name__ == "InotifyObserver"
        self._observer.schedule(_Events(self, react_to_created=not closes), str(self.directory), recursive=False)
        self._thread = threading.Thread(target=self._run, name="tokentrace-spool", daemon=True)

    def start(self) -> None:
        """Watch first, then offer what is already there, so nothing falls between the two."""
        self._observer.start()
        self._thread.start()
        for path in sorted(self.directory.iterdir()):
            self.offer(path)

    def stop(self) -> None:
        """Stop watching; files not yet ingested stay for the next start."""
        self._stop.set()
        self._observer.stop()
        self._work.put(None)
        self._thread.join(30)
        self._observer.join(5)

    def offer(self, path: Path) -> None:
        """Queue a path for ingest unless it is already queued or not a candidate."""
        if path.parent != self.directory or not is_candidate(path):
            return
        with self._lock:
            if path in self._pending:
                return
            self._pending.add(path)
        self._work.put(path)

    def snapshot(self) -> dict:
        """Counts for /healthz."""
        with self._lock:
            return {"directory": str(self.directory), "pending": len(self._pending), **self._stats}

    def _run(self) -> None:
        while not self._stop.is_set():
            path = self._work.get()
            if path is None:
                return
            attempt = 0
            while not self._stop.is_set() and not self._ingest(path):
                self._stats["retries"] += 1
                self._stop.wait(_RETRY_SECONDS[min(attempt, len(_RETRY_SECONDS) - 1)])
                attempt += 1
            with self._lock:
                self._pending.discard(path)

    def _ingest(self, path: Path) -> bool:
        """Ingest one file; False means 'try again later' (overload or store failure)."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return True  # moved away already (a duplicate event)
        except OSError as exc:
            self._reject(path, f"cannot read the file: {exc}")
            return True
        try:
            batch = self._decode(path, data)
            written = self.queue.submit(batch, SpoolRecord.of(data, path.name)).result()
        except (PayloadError, UnsupportedMediaType) as exc:
            self._reject(path, str(exc))
            return True
        except (Overloaded, StoreError) as exc:
            log.warning("spool file %s not ingested yet: %s", path.name, exc)
            return False
        self._stats["ingested" if written else "duplicates"] += 1
        self._move(path, self.ingested_dir / path.name)
        return True

    def _decode(self, path: Path, data: bytes) -> Batch:
        if len(data) > self.pipeline.max_body_bytes:
            self.counters.reject("too_large")
            raise PayloadError(f"file of {len(data)} bytes is over the limit of {self.pipeline.max_body_bytes}")
        encoding = SUFFIXES[path.suffix]
        if encoding.name == "protobuf":
            return self.pipeline.batch(data, encoding)
        batch = Batch()
        for number, document in enumerate(_json_documents(data), start=1):
            try:
                batch.extend(self.pipeline.batch(document, encoding))
            except PayloadError as exc:
                raise PayloadError(f"line {number}: {exc}") from exc
        if not batch.spans:
            raise PayloadError("the file holds no span")
        return batch

    def _reject(self, path: Path, reason: str) -> None:
        self._stats["rejected"] += 1
        target = self.rejected_dir / path.name
        self._move(path, target)
        target.with_name(target.name + ".reason.txt").write_text(reason + "\n", encoding="utf-8")
        log.warning("spool file %s rejected: %s", path.name, reason)

    @staticmethod
    def _move(path: Path, target: Path) -> None:
        if target.exists():
            target = target.with_name(f"{target.stem}.{time.time_ns()}{target.suffix}")
        with contextlib.suppress(FileNotFoundError):  # another event moved it first
            os.replace(path, target)


def _json_documents(data: bytes) -> list[bytes]:
    """One OTLP JSON document, or JSON lines of them (the OpenTelemetry Collector file exporter)."""
    try:
        json.loads(data)
        return [data]
    except (json.JSONDecodeError, UnicodeDecodeError):
        lines = [line for line in data.splitlines() if line.strip()]
        return lines if len(lines) > 1 else [data]
