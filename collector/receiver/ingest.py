"""The receive path shared by HTTP and the spool: decompress -> decode -> normalize, with reject
counters by named reason. Validation and normalization happen here, before anything is queued for
the writer, so a bad payload never reaches the store.

A protobuf payload goes through the compiled decoder (collector/decoding/fastpath.py) when it reproduces the
normalizer exactly, and through ``normalize`` otherwise; either way ``parse`` gives ``Columns``.

What a body becomes is bounded (issue 45): every span row carries a copy of its resource's
attributes and its scope's name and version, so a 0.96 MiB body of 0.9 MiB of resource attributes
and a thousand small spans became 917 MiB of columns, and two of them wedged the store's merge.
``copied_bytes`` counts those copies before anything is decoded (a skeleton of the message parsed
by protobuf's C parser: 0.04 us a span), and ``parse`` refuses a body whose columns would pass
``max_columns`` (413), before decoding from the copies and after it from the columns' size."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager

from tokentrace.collector.decoding import fastpath
from tokentrace.collector.decoding.columns import Columns
from tokentrace.collector.decoding.normalize import normalize
from tokentrace.collector.receiver.budget import EXPANSION, Hold
from tokentrace.collector.receiver.otlp import Encoding, decode, decompress
from tokentrace.errors import Overloaded, PayloadError, PayloadTooLarge, TokentraceError
from tokentrace.threads import lower_priority, name_os_thread, os_named

log = logging.getLogger("tokentrace.collector")


#: Where an acknowledged request's time went in the receiver, in order: its body received
#: (``read``); inflated, waiting for a decoding thread, decoded and checked (``decode``); with the
#: writer: exactly-once check, journal and its fdatasync, until acknowledged (``store``).
RECEIVER_STAGES = ("read", "decode", "store")
#: Upper bounds, in seconds, of the receiver's latency histograms (``le``: a time equal to a bound
#: counts in its bucket), finest around issue 17's target of 100 ms at the 99th percentile; the
#: last bucket holds everything slower than 10 s.
RECEIVER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Counters:
    """Thread-safe ingest counters: accepted spans, rejects by reason, refused spans by reason,
    typed values left out by reason, and how long acknowledged requests took in the receiver: the
    seconds spent in each stage (``RECEIVER_STAGES``) and histograms (``RECEIVER_BUCKETS``) of the
    whole request and of each stage."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.accepted_spans = 0
        self.duplicate_spans = 0
        self.rejected: Counter[str] = Counter()
        self.invalid_spans: Counter[str] = Counter()
        self.values_left_out: Counter[str] = Counter()
        self.stage_seconds = dict.fromkeys(RECEIVER_STAGES, 0.0)
        #: Requests per bucket (not cumulative; the last is past the largest bound), for the whole
        #: request (``request``) and for each stage.
        self.latency_counts = {name: [0] * (len(RECEIVER_BUCKETS) + 1) for name in ("request", *RECEIVER_STAGES)}

    def reject(self, reason: str, count: int = 1) -> None:
        """Count ``count`` rejects for ``reason`` (a snake_case name, e.g. ``malformed``)."""
        with self._lock:
            self.rejected[reason] += count

    def refuse(self, batch: Columns) -> None:
        """Count what the normalizer refused or left out of ``batch``, by reason."""
        with self._lock:
            self.invalid_spans.update(batch.rejected_by)
            self.values_left_out.update(batch.left_out)

    def accept(self, spans: int, duplicates: int = 0) -> None:
        """Count spans stored, and spans left out because they were stored already."""
        with self._lock:
            self.accepted_spans += spans
            self.duplicate_spans += duplicates

    def time_request(self, *seconds: float) -> None:
        """Add one acknowledged request's seconds in each stage, in ``RECEIVER_STAGES`` order (the
        stages follow one another: the request took their sum)."""
        with self._lock:
            for stage, spent in zip(RECEIVER_STAGES, seconds, strict=True):
                self.stage_seconds[stage] += spent
                self.latency_counts[stage][bisect_left(RECEIVER_BUCKETS, spent)] += 1
            self.latency_counts["request"][bisect_left(RECEIVER_BUCKETS, sum(seconds))] += 1

    def snapshot(self) -> dict:
        """A JSON-ready copy."""
        with self._lock:
            return {"accepted_spans": self.accepted_spans, "duplicate_spans": self.duplicate_spans,
                    "rejected": dict(self.rejected), "invalid_spans": dict(self.invalid_spans),
                    "values_left_out": dict(self.values_left_out),
                    "receiver": {"requests": sum(self.latency_counts["request"]),
                                 "seconds": {stage: round(spent, 6) for stage, spent in self.stage_seconds.items()},
                                 "le": list(RECEIVER_BUCKETS),
                                 "counts": {name: list(counts) for name, counts in self.latency_counts.items()}}}


def max_columns_of(max_body_bytes: int) -> int:
    """The most bytes of columns a body may become: what the largest body allowed becomes at the
    budget's ``EXPANSION`` (6 x --max-body-bytes: 96 MiB by default)."""
    return EXPANSION * max_body_bytes


_SKELETON = None


def _skeleton():
    """A message class that reads an ExportTraceServiceRequest down to its spans, each span,
    resource and scope left as bytes: parsing it walks the body in C and builds no span."""
    global _SKELETON
    if _SKELETON is None:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

        proto = descriptor_pb2.FileDescriptorProto(name="tokentrace_skeleton.proto", package="tokentrace.skeleton",
                                                   syntax="proto3")
        field = descriptor_pb2.FieldDescriptorProto
        for name, fields in (("Request", (("resource_spans", 1, "ResourceSpans"),)),
                             ("ResourceSpans", (("resource", 1, None), ("scope_spans", 2, "ScopeSpans"))),
                             ("ScopeSpans", (("scope", 1, None), ("spans", 2, None)))):
            message = proto.message_type.add(name=name)
            for field_name, number, kind in fields:
                label = field.LABEL_REPEATED if field_name.endswith("s") else field.LABEL_OPTIONAL
                added = message.field.add(name=field_name, number=number, label=label,
                                          type=field.TYPE_BYTES if kind is None else field.TYPE_MESSAGE)
                if kind is not None:
                    added.type_name = f".tokentrace.skeleton.{kind}"
        pool = descriptor_pool.DescriptorPool()
        pool.Add(proto)
        _SKELETON = message_factory.GetMessageClass(pool.FindMessageTypeByName("tokentrace.skeleton.Request"))
    return _SKELETON


def copied_bytes(payload: bytes, encoding: Encoding) -> int:
    """Bytes of the copies of their resource and scope the span rows of a protobuf payload would
    carry: (resource + scope) x spans, summed over its scopes (0 for JSON, and for a body that does
    not parse: the decoder refuses it)."""
    if encoding.name != "protobuf":
        return 0
    from google.protobuf.message import DecodeError

    try:
        request = _skeleton().FromString(payload)
    except DecodeError:
        return 0
    return _copies(request)


def _copies(request) -> int:
    """``copied_bytes`` of a parsed request (a skeleton's: sizes of bytes; a real one's: ByteSize)."""
    total = 0
    for resource_spans in request.resource_spans:
        resource = _size(resource_spans.resource)
        for scope_spans in resource_spans.scope_spans:
            total += (resource + _size(scope_spans.scope)) * len(scope_spans.spans)
    return total


def _size(part) -> int:
    return len(part) if isinstance(part, bytes) else part.ByteSize()


def _refuse_amplified(copies: int, payload: bytes, max_columns: int | None, done: bool = False) -> None:
    """PayloadTooLarge when the columns of ``payload`` (``copies``: estimated by its copies of its
    resource and scope, or, once ``done``, its columns' size) pass ``max_columns``."""
    if max_columns is None or copies <= max_columns:
        return
    what = "became" if done else "would become"
    raise PayloadTooLarge(
        f"a body of {len(payload)} bytes {what} {copies} bytes of columns (each span row carries a copy of its "
        f"resource's attributes and its scope), over the limit of {max_columns} bytes (6 x --max-body-bytes, "
        f"at most --max-pending-bytes): "
        f"send fewer spans per resource, or smaller resource attributes")


def parse(body: bytes, encoding: Encoding, content_encoding: str | None, max_body_bytes: int,
          max_value_length: int, fast: bool = True, max_columns: int | None = None) -> Columns:
    """Decompress, decode and normalize one payload into Arrow columns (through the compiled decoder
    unless ``fast`` is False); PayloadTooLarge when its columns would pass ``max_columns`` (module
    docstring). Pure, so it runs in a worker process as well."""
    payload = decompress(body, content_encoding, max_body_bytes)
    if fast:
        _refuse_amplified(copied_bytes(payload, encoding), payload, max_columns)
        columns = _decoded(payload, encoding, max_value_length)
    else:
        columns = None
    if columns is None:
        request = decode(payload, encoding)
        _refuse_amplified(_copies(request), payload, max_columns)
        columns = normalize(request, max_value_length).columns()
    _refuse_amplified(columns.nbytes, payload, max_columns, done=True)
    return columns


def _decoded(payload: bytes, encoding: Encoding, max_value_length: int) -> Columns | None:
    """The compiled decoder's columns of a protobuf payload, or None (the normalizer's to do)."""
    return fastpath.decode(payload, max_value_length) if encoding.name == "protobuf" else None


def _parse_in_worker(*args) -> bytes:
    """What the compiled decoder left to the normalizer, in a worker process: the columns go back as
    bytes (Columns.to_bytes), read in the collector's process without copying."""
    return parse(*args, fast=False, max_columns=max_columns_of(args[3])).to_bytes()


def _start_worker(parent_pid: int) -> None:
    """Worker initializer: import the parsing modules now, and exit when the collector is gone.

    A collector killed with SIGKILL cannot stop its pool; its workers would wait on their queue
    forever. Re-parented workers notice within a second and exit.
    """
    import tokentrace.collector.decoding.normalize  # noqa: F401

    name_os_thread("tokentrace-parse")  # `ps` and `top` show the worker process as tt-parse

    fastpath.unavailable()  # the decoder's one-time configuration, before the first payload

    def exit_with_parent() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=os_named(exit_with_parent), name="tokentrace-parent-watch", daemon=True).start()


#: Threads that decode the event loop's payloads: the decoder holds no GIL while it walks a body,
#: so more threads than cores only queue; requests beyond them wait inside the memory bound.
DECODE_THREADS = min(32, max(4, 2 * (os.cpu_count() or 1)))


def _decoding_thread(nice: int) -> None:
    """A decoding thread's start: named in the system (``tt-decode_N``), its priority lowered by ``nice``."""
    name_os_thread()
    lower_priority(nice)


class Pipeline:
    """Turns payloads into Columns, counting refusals: protobuf through the compiled decoder on a
    thread of this process, and what it leaves to the normalizer in worker processes when
    ``workers`` > 0.

    The decoder holds no GIL while it decodes, so on a thread it has the machine's other core
    without a process: shipping its columns back from a worker (pickling, a pipe, a copy on each
    side) cost four times the decoding itself (py-spy, docs/benchmarks.md). The normalizer is
    CPU-bound Python; in the collector's process it would share one core (the GIL) with HTTP and the
    writer, so worker processes give it the other cores. A worker that dies breaks its pool: the
    pool is rebuilt and the payload parsed in-process, so no request fails.

    The event loop's payloads are decoded on threads of their own (``DECODE_THREADS``), ``nice``
    higher than the collector by ``decode_nice`` (Linux: each thread has its own). The DuckDB
    store appends acknowledged batches to its tables on one merge thread, the one stage that cannot
    spread over cores; when it waited for a core behind the decoders, its backlog reached the memory
    bound, every sender was refused for a second (503) and only the merge ran meanwhile. With the
    decoders at +10 the merge gets a core first and they take the rest: 4-13 % more engine spans/s
    into the tables and fewer refusals in four pairs of five; where the machine is short of CPU,
    acknowledgements wait longer instead (p99 +18 ms; bench/ingest.py side by side,
    docs/benchmarks.md, Issue 17, eighth round).
    """

    def __init__(self, counters: Counters, max_body_bytes: int, max_value_length: int, workers: int = 0,
                 decode_nice: int = 0):
        self.counters = counters
        self.max_body_bytes = max_body_bytes
        self.max_value_length = max_value_length
        self.workers = workers
        self.decode_nice = decode_nice
        self._pool: ProcessPoolExecutor | None = None
        self._decoders: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the decoding threads' pool and the worker processes (none when ``workers`` is 0)."""
        self._decoders = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="tokentrace-decode",
                                            initializer=_decoding_thread, initargs=(self.decode_nice,))
        if self.workers > 0:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start_worker, initargs=(os.getpid(),))

    def stop(self) -> None:
        """Stop the workers and decoding threads after the payloads they hold."""
        with self._lock:
            pool, self._pool = self._pool, None
            decoders, self._decoders = self._decoders, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=False)
        if decoders is not None:
            decoders.shutdown(wait=True, cancel_futures=False)

    async def _decoding(self, function, *args):
        """``function(*args)`` on a decoding thread (the event loop's default executor before ``start``)."""
        return await asyncio.get_running_loop().run_in_executor(self._decoders, function, *args)

    def batch(self, body: bytes, encoding: Encoding, content_encoding: str | None = None,
              hold: Hold | None = None) -> Columns:
        """Parse one payload (blocking); PayloadError, counted, when nothing in it can be used.
        ``hold`` (the request's share of the byte budget) is charged for what the body becomes
        beyond ``EXPANSION`` x its size (module docstring); Overloaded when that does not fit."""
        args = (body, encoding, content_encoding, self.max_body_bytes, self.max_value_length)
        with self._counting_refusals():
            batch = self._fast(*args, hold)
            pool = self._pool
            try:
                if batch is None:
                    batch = Columns.from_bytes(pool.submit(_parse_in_worker, *args).result()) if pool is not None \
                        else self._slow(*args)
            except BrokenProcessPool:
                self._rebuild(pool)
                batch = self._slow(*args)
        return self._checked(batch, hold)

    async def batch_async(self, body: bytes, encoding: Encoding, content_encoding: str | None = None,
                          hold: Hold | None = None) -> Columns:
        """``batch`` for the event loop: the compiled decoder on a thread (it holds no GIL while it
        decodes), and what it leaves to the normalizer on a worker, or a thread without workers."""
        if self._pool is None:
            return await self._decoding(self.batch, body, encoding, content_encoding, hold)
        args = (body, encoding, content_encoding, self.max_body_bytes, self.max_value_length)
        pool = self._pool
        with self._counting_refusals():
            batch = await self._decoding(self._fast, *args, hold) if encoding.name == "protobuf" else None
            try:
                if batch is None:
                    batch = Columns.from_bytes(await asyncio.wrap_future(pool.submit(_parse_in_worker, *args)))
            except BrokenProcessPool:
                self._rebuild(pool)
                batch = await self._decoding(self._slow, *args)
        return self._checked(batch, hold)

    def _slow(self, *args) -> Columns:
        """``parse`` by the normalizer, in this process."""
        return parse(*args, fast=False, max_columns=max_columns_of(self.max_body_bytes))

    def _fast(self, body: bytes, encoding: Encoding, content_encoding: str | None, max_body_bytes: int,
              max_value_length: int, hold: Hold | None = None) -> Columns | None:
        if encoding.name != "protobuf":
            return None
        payload = decompress(body, content_encoding, max_body_bytes)
        copies = copied_bytes(payload, encoding)
        bound = max_columns_of(max_body_bytes)
        if hold is not None:  # more than the whole budget could never be held (the first request alone
            bound = min(bound, hold.budget.limit)  # is admitted past it: budget.py)
        _refuse_amplified(copies, payload, bound)
        # Copies up to the body's own size are inside the EXPANSION measured (resources of a few
        # hundred bytes on spans of as many); what they add beyond it is held before they exist.
        if hold is not None and copies > len(payload) and not hold.take(copies - len(payload)):
            raise Overloaded(f"the collector holds as many request bytes as --max-pending-bytes allows "
                             f"({hold.budget.limit}), and this body becomes {copies} bytes of copies of its "
                             f"resource; retry later", retry_after=1)
        columns = _decoded(payload, encoding, max_value_length)
        if columns is not None:  # what the store journals: the payload parses to these columns again
            _refuse_amplified(columns.nbytes, payload, max_columns_of(max_body_bytes), done=True)
            columns.sources = [(encoding.name, max_value_length, payload, columns.spans)]
        # Their bytes (which the receiver holds against the budget from its event loop) come counted
        # by the decoder (fastpath.imported): counting them on the loop took 17 % of its busy time.
        return columns

    @contextmanager
    def _counting_refusals(self) -> Iterator[None]:
        """Count a payload refused while decoding, by reason, and let the error through."""
        try:
            yield
        except TokentraceError as exc:
            self.counters.reject(exc.code)
            exc.counted = True  # the receiver counts what was not counted here
            raise

    def _rebuild(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is broken:
                log.error("a parse worker died; restarting the worker pool")
                self._pool = None
                self.start()
        broken.shutdown(wait=False, cancel_futures=True)

    def _checked(self, batch: Columns, hold: Hold | None = None) -> Columns:
        if hold is not None and batch.nbytes > hold.bytes:  # they exist: held, whatever the budget says
            hold.add(batch.nbytes - hold.bytes)
        if batch.rejected:
            self.counters.reject("invalid_span", batch.rejected)
        if batch.truncated:
            self.counters.reject("truncated_value", batch.truncated)
        if batch.rejected or batch.left_out:
            self.counters.refuse(batch)
        if batch.rejected and not batch.spans:
            error = PayloadError(f"no valid span in the request: {batch.message()}")
            error.counted = True  # as invalid_span, above
            raise error
        return batch
