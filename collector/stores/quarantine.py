"""What the DuckDB store could not keep, set aside with what was lost (issue 45: damage is
contained and reported, never spread).

A journal record whose checksum fails in the middle of the log, a batch the tables cannot take,
a span file that cannot be read: each is moved or copied to ``STORE.quarantine/`` (beside the
store's file, its journal and span folders) instead of stopping the store or being replayed into
the same wall at every start, and one line of ``losses.jsonl`` there says what it was, why it was
set aside and what it held (sequence numbers, byte range, spans, time range). The same line is
logged as an error, and ``/healthz`` shows the count and the latest (``journal.quarantine``).
Nothing here is deleted by the collector: an operator may inspect it, repair it, or remove it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("tokentrace.collector")

#: Entries /healthz shows, the latest last.
SHOWN = 20


class Quarantine:
    """The quarantine folder of one store (module docstring)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._lock = threading.Lock()
        self._entries = self._read()

    def _read(self) -> list[dict]:
        path = self.folder / "losses.jsonl"
        if not path.exists():
            return []
        entries = []
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash: the file it names is still there
                continue
        return entries

    def keep(self, kind: str, name: str | None = None, data: bytes | memoryview | None = None,
             source: Path | None = None, **facts) -> dict:
        """Set aside ``data`` (written) or ``source`` (moved) as ``name`` with what it was (``kind``)
        and ``facts`` (what it held and why), logged as an error; without a ``name``, only the
        loss is recorded (a journal segment that is gone). Returns the entry."""
        with self._lock:
            self.folder.mkdir(exist_ok=True)
            target = None if name is None else self.folder / name
            if target is not None and source is not None:
                os.replace(source, target)
            elif target is not None and data is not None:
                with open(target, "wb") as handle:
                    handle.write(data)
                    os.fsync(handle.fileno())
            entry = {"kind": kind, "file": None if target is None else str(target), "at_ns": time.time_ns(), **facts}
            with open(self.folder / "losses.jsonl", "a", encoding="utf-8") as handle:
                handle.write(json.dumps(entry) + "\n")
                os.fsync(handle.fileno())
            directory = os.open(self.folder, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
            self._entries.append(entry)
        log.error("quarantined %s: %s", kind, json.dumps(entry))
        return entry

    def entries(self) -> list[dict]:
        """Every entry of ``losses.jsonl``, oldest first (a copy)."""
        with self._lock:
            return list(self._entries)

    def snapshot(self) -> dict:
        """For /healthz: how many entries, and the latest."""
        with self._lock:
            return {"folder": str(self.folder), "entries": len(self._entries), "latest": self._entries[-SHOWN:]}
