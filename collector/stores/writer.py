"""The one writer thread: owns the store's write role, drains submitted batches in groups, commits,
and only then resolves each submitter's future, so nothing is acknowledged before it is durable.

The thread is supervised: whatever a write raises, the store has rolled back its transaction, only
the requests of that group fail (a failed group is retried batch by batch, so only the batch at
fault fails), and the thread takes the next group. Only ``close`` ends it."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from tokentrace.collector.decoding.columns import Columns
from tokentrace.collector.stores.store import SpoolRecord, TraceWriter
from tokentrace.errors import Overloaded, RejectedBatch, StoreError
from tokentrace.threads import os_named

log = logging.getLogger("tokentrace.collector")
_STOP = object()


class WriteQueue:
    """Bounded queue in front of the writer; ``submit`` never blocks."""

    def __init__(self, writer: TraceWriter, on_written, max_pending: int = 256, group_spans: int = 50_000):
        self._writer = writer
        self._on_written = on_written
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._group_spans = group_spans
        self.capacity = max_pending
        self.last_error: str | None = None  #: why the latest write failed, until one succeeds
        self.last_error_at = 0.0  #: time.monotonic() of that failure
        self._thread = threading.Thread(target=os_named(self._run), name="tokentrace-writer", daemon=True)
        self._thread.start()

    def submit(self, batch: Columns, spool: SpoolRecord | None = None,
               on_released: Callable[[], None] | None = None) -> Future:
        """Queue a batch; the future resolves to the writer's result once committed. ``on_released``
        is called once the store holds none of the batch in memory, if its write succeeds
        (TraceWriter contract)."""
        future: Future = Future()
        try:
            self._queue.put_nowait((batch, spool, future, on_released))
        except queue.Full:
            raise Overloaded(f"the write queue is full ({self.capacity} batches waiting)", retry_after=1) from None
        return future

    def depth(self) -> int:
        """Batches waiting for the writer."""
        return self._queue.qsize()

    def alive(self) -> bool:
        """Whether the writer thread is running."""
        return self._thread.is_alive()

    def close(self, timeout: float = 30.0) -> None:
        """Write everything already submitted, then stop the thread."""
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            item = self._queue.get()
            if item is _STOP:
                break
            group, spans = [item], item[0].spans
            while spans < self._group_spans:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                    break
                group.append(item)
                spans += item[0].spans
            try:
                self._write_group(group)
            except BaseException as exc:  # supervision: only _STOP ends this thread (issue 11)
                log.exception("unexpected error in the writer; failing its group and going on")
                for _batch, _spool, future, _stored in group:
                    if not future.done():
                        future.set_exception(StoreError(f"unexpected writer error: {exc!r}"))

    def _write_group(self, group: list) -> None:
        plain = [item for item in group if item[1] is None]
        if len(plain) > 1 and getattr(self._writer, "group_writes", True):
            merged = Columns.concat([batch for batch, _, _, _ in plain])
            try:
                self._writer.write(merged, on_released=_all_of([stored for _, _, _, stored in plain]))
            except Exception as exc:  # the store rolled back; find the batch that failed, alone
                log.warning("group write failed, retrying batch by batch: %s", exc)
            else:
                self._on_written(merged)
                self._done(plain, True, count=False)
                plain = []
        for item in plain + [item for item in group if item[1] is not None]:
            self._write_one(item)

    def _write_one(self, item: tuple) -> None:
        batch, spool, future, stored = item
        try:
            result = self._writer.write(batch, spool, on_released=stored)
        except RejectedBatch as exc:  # this batch's values: its sender hears 400, the store is fine
            log.warning("the store refused a batch: %s", exc)
            future.set_exception(exc)
        except StoreError as exc:
            self.last_error, self.last_error_at = str(exc), time.monotonic()
            future.set_exception(exc)
        except Exception as exc:  # a bug must fail the request, never kill the writer thread
            log.exception("unexpected error in the writer")
            future.set_exception(StoreError(f"unexpected writer error: {exc!r}"))
        else:
            self._done([item], result)

    def _done(self, items: list, result: bool, count: bool = True) -> None:
        self.last_error = None
        for batch, _spool, future, _stored in items:
            if result and count:
                self._on_written(batch)
            future.set_result(result)


def _all_of(calls: list[Callable[[], None] | None]) -> Callable[[], None]:
    """One callback that calls each of ``calls`` (None: nothing)."""
    chosen = [call for call in calls if call is not None]
    return lambda: [call() for call in chosen]
