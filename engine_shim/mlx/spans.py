"""Turn finished records into OpenTelemetry spans with explicit timestamps (docs/telemetry.md).

Runs on the telemetry thread, never in the generation loop. Only the OpenTelemetry *API* is used
here; whoever owns the process (the CLI, or an embedding application) wires the SDK.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from tokentrace import contract as c
from tokentrace import hardware
from tokentrace.engine_shim.emit import encode
from tokentrace.engine_shim.mlx.records import (
    Clock,
    HeartbeatRecord,
    LifecycleRecord,
    LoadRecord,
    RequestRecord,
    StepWindow,
)
from tokentrace.fingerprint import block_hashes, segment_hash, segment_tail_hash

_MS = 1e-6


def percentile(sorted_values: Sequence[int], fraction: float) -> int:
    """Nearest-rank percentile of an ascending sequence (0 for an empty one)."""
    if not sorted_values:
        return 0
    rank = max(1, round(fraction * len(sorted_values) + 0.5 - 1e-9))
    return sorted_values[min(rank, len(sorted_values)) - 1]


class SpanBuilder:
    """Builds the contract's spans from records on a tracer."""

    def __init__(self, tracer: trace.Tracer, clock: Clock, block_size: int = c.DEFAULT_BLOCK_SIZE):
        self.tracer = tracer
        self.clock = clock
        self.block_size = block_size
        self._handlers = {
            RequestRecord: self.request,
            StepWindow: self.steps,
            LoadRecord: self.load,
            LifecycleRecord: self.lifecycle,
            HeartbeatRecord: self.heartbeat,
        }

    def build(self, record: Any) -> None:
        """The spans of any finished record (request, step window, load, lifecycle, heartbeat)."""
        self._handlers[type(record)](record)

    def _open(self, name: str, start: int, attributes: dict[str, Any], parent: trace.Span | None = None,
              kind: SpanKind = SpanKind.INTERNAL) -> trace.Span:
        context = trace.set_span_in_context(parent) if parent is not None else None
        return self.tracer.start_span(name, context=context, kind=kind, attributes=attributes,
                                      start_time=self.clock.epoch(start))

    def _close(self, span: trace.Span, start: int, end: int) -> None:
        span.end(end_time=self.clock.epoch(max(start, end)))

    def _leaf(self, name: str, start: int, end: int, attributes: dict[str, Any],
              parent: trace.Span | None = None) -> None:
        self._close(self._open(name, start, attributes, parent), start, end)

    # --- requests ------------------------------------------------------------------------------
    def request(self, record: RequestRecord) -> None:
        """The llm.request tree of one finished request."""
        rid = {c.REQUEST_ID: record.request_id}
        end = max(record.end_ns, record.finish_ns, record.arrival_ns)
        root = self._open(c.SPAN_REQUEST, record.arrival_ns, _request_attributes(record), kind=SpanKind.SERVER)
        if record.http_status >= 500 or record.finish_reason == "error":
            root.set_status(Status(StatusCode.ERROR, record.error_type or "error"))
        if record.first_response:
            root.add_event(c.EVENT_FIRST_RESPONSE, timestamp=self.clock.epoch(end))
        if record.load_wait_start_ns:
            self._leaf(c.SPAN_LOAD_WAIT, record.load_wait_start_ns, record.load_wait_end_ns,
                       {**rid, c.LOAD_ID: record.load_id or ""}, root)
        if record.enqueue_ns:
            queue_end = record.admit_ns or record.finish_ns or end
            self._leaf(c.SPAN_QUEUE, record.enqueue_ns, queue_end, {
                **rid, c.QUEUE_DEPTH: record.queue_depth, c.QUEUE_RUNNING: record.queue_running,
                c.MAX_BATCH: record.max_batch}, root)
        if record.lookup is not None:
            self._lookup(record, root, rid)
        if record.admit_ns:
            self._prefill(record, root, rid)
        if record.token_ns:
            self._decode(record, root, rid)
        if record.insertion is not None:
            self._insert(record, root, rid)
        self._close(root, record.arrival_ns, end)

    def _lookup(self, record: RequestRecord, root: trace.Span, rid: dict[str, Any]) -> None:
        lookup, prompt = record.lookup, record.prompt
        attributes = {
            **rid,
            c.CACHE_PROMPT_TOKENS: prompt.length,
            c.CACHE_MATCHED_TOKENS: lookup.reused,
            c.CACHE_MATCH: lookup.kind,
            **encode.cache_state(c.UNIT_ENTRY, lookup.entries, lookup.nbytes),
        }
        if not prompt.unknown_prefix:
            attributes.update({
                c.CACHE_BLOCK_SIZE: self.block_size,
                c.CACHE_BLOCK_HASHES: block_hashes(prompt.tokens, self.block_size),
                c.SEGMENT_ROLES: list(prompt.roles),
                c.SEGMENT_STARTS: list(prompt.starts),
                c.SEGMENT_ENDS: list(prompt.ends),
                c.SEGMENT_HASHES: [
                    segment_hash(prompt.tokens[s:e]) for s, e in zip(prompt.starts, prompt.ends, strict=True)],
                c.SEGMENT_TAIL_HASHES: [segment_tail_hash(prompt.tokens[s:e], self.block_size)
                                        for s, e in zip(prompt.starts, prompt.ends, strict=True)],
            })
        if lookup.entry_tokens is not None:
            attributes[c.CACHE_MATCHED_ENTRY] = self.fingerprint(lookup.entry_tokens)
        if prompt.snippets is not None and not prompt.unknown_prefix:
            attributes[c.SEGMENT_SNIPPETS] = list(prompt.snippets)
        self._leaf(c.SPAN_CACHE_LOOKUP, record.admit_ns, record.lookup_end_ns or record.admit_ns, attributes, root)

    def _prefill(self, record: RequestRecord, root: trace.Span, rid: dict[str, Any]) -> None:
        end = record.token_ns[0] if record.token_ns else (record.finish_ns or record.admit_ns)
        span = self._open(c.SPAN_PREFILL, record.admit_ns, {
            **rid, c.PREFILL_TOKENS: sum(record.chunk_tokens), c.PREFILL_CHUNKS: len(record.chunk_tokens)}, root)
        chunks = zip(record.chunk_start_ns, record.chunk_end_ns, record.chunk_offset, record.chunk_tokens,
                     record.chunk_batch, strict=True)
        for start, stop, offset, tokens, batch in chunks:
            self._leaf(c.SPAN_PREFILL_CHUNK, start, stop, {
                **rid, c.CHUNK_OFFSET: offset, c.CHUNK_TOKENS: tokens, c.CHUNK_BATCH_SIZE: batch}, span)
        self._close(span, record.admit_ns, end)

    def _decode(self, record: RequestRecord, root: trace.Span, rid: dict[str, Any]) -> None:
        times = record.token_ns
        first = times[0]
        gaps = sorted(b - a for a, b in itertools.pairwise(times))
        self._leaf(c.SPAN_DECODE, first, times[-1], {
            **rid,
            c.DECODE_STEPS: len(times),
            c.DECODE_STEP_OFFSETS: [t - first for t in times],
            c.ITL_P50_MS: percentile(gaps, 0.5) * _MS,
            c.ITL_P90_MS: percentile(gaps, 0.9) * _MS,
            c.ITL_MAX_MS: (gaps[-1] if gaps else 0) * _MS,
        }, root)

    def _insert(self, record: RequestRecord, root: trace.Span, rid: dict[str, Any]) -> None:
        insertion = record.insertion
        hashes = block_hashes(insertion.tokens, self.block_size)
        span = self._open(c.SPAN_CACHE_INSERT, record.insert_start_ns, {
            **rid,
            c.ENTRY_FINGERPRINT: hashes[-1] if hashes else 0,
            c.ENTRY_TOKENS: len(insertion.tokens),
            c.ENTRY_BYTES: insertion.nbytes,
            c.CACHE_BLOCK_SIZE: self.block_size,
            c.CACHE_BLOCK_HASHES: hashes,
            **encode.cache_state(c.UNIT_ENTRY, insertion.entries_after, insertion.bytes_after),
            c.CACHE_MAX_ENTRIES: insertion.max_entries,
            c.CACHE_MAX_BYTES: insertion.max_bytes,
            **({c.CACHE_LIMIT_RANK: insertion.limit_rank} if insertion.limit_rank is not None else {}),
        }, root)
        at = self.clock.epoch(record.insert_end_ns)
        for eviction in insertion.evictions:
            span.add_event(c.EVENT_CACHE_EVICT, timestamp=at, attributes=encode.eviction(
                unit=c.UNIT_ENTRY, tokens=len(eviction.tokens), reason=eviction.reason,
                fingerprint=self.fingerprint(eviction.tokens), nbytes=eviction.nbytes,
                request_id=eviction.request_id, entries_after=eviction.entries_after,
                bytes_after=eviction.bytes_after,
            ))
        self._close(span, record.insert_start_ns, record.insert_end_ns)

    def fingerprint(self, tokens: Sequence[int]) -> int:
        """An entry's fingerprint: the last chained block hash of its tokens."""
        hashes = block_hashes(tokens, self.block_size)
        return hashes[-1] if hashes else 0

    # --- instance ------------------------------------------------------------------------------
    def steps(self, window: StepWindow) -> None:
        """One engine.steps span for a window of steps."""
        start, end, attributes = encode.steps_window(
            window.start_ns, window.duration_ns, window.prefill_seqs, window.decode_seqs,
            window.prefill_tokens, window.decode_tokens, window.members)
        if window.compute_ns:  # a pipeline rank: its compute and ring waits on the steps it timed
            attributes[c.STEPS_COMPUTE] = list(window.compute_ns)
            attributes[c.STEPS_RING_WAIT] = list(window.ring_wait_ns)
            attributes[c.STEPS_RING_WAIT_CPU] = list(window.ring_wait_cpu_ns)
        self._leaf(c.SPAN_ENGINE_STEPS, start, end, attributes)

    def load(self, record: LoadRecord) -> None:
        """model.load with its stages; instance.ready when it succeeded."""
        load_id = {c.LOAD_ID: record.load_id}
        root = self._open(c.SPAN_MODEL_LOAD, record.start_ns, {
            **load_id, c.LOAD_LAZY: record.lazy, c.MODEL_PATH: record.path})
        for name, start, end, extra in record.stages:
            self._leaf(name, start, end, {**load_id, **extra}, root)
        if record.error is None:
            root.add_event(c.EVENT_READY, timestamp=self.clock.epoch(record.end_ns))
        else:
            root.set_status(Status(StatusCode.ERROR, record.error))
        self._close(root, record.start_ns, record.end_ns)

    def lifecycle(self, record: LifecycleRecord) -> None:
        """An instance.lifecycle span carrying one lifecycle event."""
        span = self._open(c.SPAN_LIFECYCLE, record.at_ns, {})
        span.add_event(record.event, timestamp=self.clock.epoch(record.at_ns))
        self._close(span, record.at_ns, record.at_ns)

    def heartbeat(self, record: HeartbeatRecord) -> None:
        """An instance.heartbeat span (zero length)."""
        attributes = encode.heartbeat(
            unit=c.UNIT_ENTRY, queue_depth=record.queue_depth, running=record.running,
            max_batch=record.max_batch, cache_entries=record.cache_entries, cache_bytes=record.cache_bytes,
            cache_max_entries=record.cache_max_entries, cache_max_bytes=record.cache_max_bytes,
            kv_bytes_per_token=record.kv_bytes_per_token, memory_bytes=record.memory_bytes,
            memory_free=max(0, record.memory_limit_bytes - record.memory_bytes) if record.memory_limit_bytes
            else hardware.available_memory(),
        )
        if record.stall is not None:
            state, reason, ms, open_ids, ranks = record.stall
            attributes.update({c.STALL_STATE: state, c.STALL_REASON: reason, c.STALL_MS: ms,
                               c.OPEN_REQUESTS: list(open_ids), c.STALL_RANKS: list(ranks)})
        if record.stall_watch_ms is not None:
            attributes[c.STALL_RANK_TIMEOUT_MS] = record.stall_watch_ms
        if record.cache_limit_rank is not None:
            attributes[c.CACHE_LIMIT_RANK] = record.cache_limit_rank
        self._leaf(c.SPAN_HEARTBEAT, record.at_ns, record.at_ns, attributes)


def _request_attributes(record: RequestRecord) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        c.REQUEST_ID: record.request_id,
        c.ENDPOINT: record.endpoint,
        c.STREAMED: record.streamed,
        c.CLIENT_DISCONNECTED: record.client_disconnected,
        c.HTTP_STATUS: record.http_status,
        c.OUTPUT_TOKENS: record.completion_tokens,
        c.PROVIDER_NAME: c.ENGINE_MLX,
        c.RESPONSE_ID: record.request_id,
    }
    if record.endpoint.endswith("completions"):
        attributes[c.OPERATION_NAME] = (c.OPERATION_CHAT if record.endpoint.endswith("chat/completions")
                                        else c.OPERATION_TEXT_COMPLETION)
    optional = {
        c.SESSION_ID: record.session_id,
        c.MODEL: record.model,
        c.MAX_TOKENS: record.max_tokens,
        c.ERROR_TYPE: record.error_type,
    }
    attributes.update({k: v for k, v in optional.items() if v is not None})
    if record.prompt is not None:
        attributes[c.INPUT_TOKENS] = record.prompt_tokens
    if record.lookup is not None:
        attributes[c.CACHED_TOKENS] = record.cached_tokens
    if record.finish_reason is not None:
        attributes[c.FINISH_REASONS] = [record.finish_reason]
    if record.first_content_ns:
        attributes[c.FIRST_CONTENT_MS] = (record.first_content_ns - record.arrival_ns) * _MS
    if record.enqueue_ns:
        attributes[c.LOAD_WAIT_MS] = (record.load_wait_end_ns - record.load_wait_start_ns) * _MS
        queue_end = record.admit_ns or record.finish_ns
        attributes[c.QUEUE_MS] = max(0, queue_end - record.enqueue_ns) * _MS
    if record.admit_ns and record.token_ns:
        first, last = record.token_ns[0], record.token_ns[-1]
        attributes[c.PREFILL_MS] = (first - record.admit_ns) * _MS
        attributes[c.DECODE_MS] = (last - first) * _MS
        attributes[c.TTFT_MS] = (first - record.arrival_ns) * _MS
        if len(record.token_ns) > 1:
            attributes[c.TPOT_MS] = (last - first) * _MS / (len(record.token_ns) - 1)
    return attributes
