"""Conversion of OTLP spans into rows of the typed tables (DESIGN §4). Pure functions, no I/O.

Every span becomes one row of ``spans``. Spans of the telemetry contract also become rows of their
typed tables; columnar attributes (decode step offsets, engine-step arrays, block hashes, segments)
are expanded into one row per element and left out of ``spans.attributes``. Events are read by
name wherever they ride: ``llm.cache.evict`` gives ``cache_evictions`` rows and the lifecycle events
give ``instance_events`` rows. Spans of other senders land in ``spans`` only.

Column order of every table is ``TABLES[name]``; it matches the DDL (tests/test_collector_ingest.py).
The two tables that grow by one row per token or block, ``decode_steps`` and ``prefix_blocks``,
travel packed (one row per span with a list column, ``PACKED``) and the store expands them in SQL:
building a Python tuple per token costs more than parsing the span. ``Batch.expanded`` gives the
same rows in Python, as the reference for what a store must produce.
"""

from __future__ import annotations

import base64
import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace import contract as c
from tokentrace.collector.decoding.tables import PACKED, TABLES  # column orders: tables.py
from tokentrace.engine_shim import translations

# The legacy GenAI spellings a contract llm.request may carry (gen_ai.usage.prompt_tokens, vLLM's
# latency attributes in seconds); they live with vLLM's names, which use them.
from tokentrace.engine_shim.vllm import names as v

if TYPE_CHECKING:
    from tokentrace.collector.decoding.columns import Columns

#: Attributes expanded into typed rows and therefore not repeated in ``spans.attributes``.
EXPANDED = frozenset({
    c.CACHE_BLOCK_HASHES, c.DECODE_STEP_OFFSETS, c.SEGMENT_ROLES, c.SEGMENT_STARTS, c.SEGMENT_ENDS,
    c.SEGMENT_HASHES, c.SEGMENT_TAIL_HASHES, c.SEGMENT_SNIPPETS, c.STEPS_START_OFFSETS, c.STEPS_DURATIONS,
    c.STEPS_PREFILL_SEQS, c.STEPS_DECODE_SEQS, c.STEPS_PREFILL_TOKENS, c.STEPS_DECODE_TOKENS,
    c.STEPS_REQUESTS, c.STEPS_MEMBERS,
})

DEFAULT_MAX_VALUE_LENGTH = 65_536
#: The row lists of a Batch in a fixed order: ``Batch.marks`` has one column per entry.
MARKED: tuple[str, ...] = (*(name for name in TABLES if name not in PACKED), *PACKED)
#: Times are stored as signed 64-bit nanoseconds (until 2262); OTLP's are unsigned (fixed64), so a
#: span whose times do not fit is refused (issue 11).
MAX_TIME_NS = 2**63 - 1
_INT64 = (-(2**63), 2**63 - 1)
#: Largest duration a ``*_ms`` summary may hold: 1e10 ms (116 days). Beyond it, and for NaN,
#: infinities and negative values, the typed column is left empty (the attribute stays as sent).
MAX_MS = 1e10


class _Untyped(Exception):
    """A contract span's attributes break the contract's types or ranges: the span is stored in
    ``spans`` with every attribute as sent, and no typed rows (``reason`` is the counter)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def partial_success_message(problems: list[str], truncated: int) -> str:
    """OTLP's partial-success message for a parsed payload (Batch or Columns): the first three
    problems, how many more, and how many attribute values were cut, in one line."""
    parts = list(problems[:3])
    if len(problems) > 3:
        parts.append(f"and {len(problems) - 3} more")
    if truncated:
        parts.append(f"{truncated} attribute values were truncated to the length limit")
    return "; ".join(parts)


@dataclass
class Batch:
    """Rows for every table (lists of tuples in ``TABLES`` column order) plus what was refused."""

    rows: dict[str, list[tuple]] = field(default_factory=lambda: {n: [] for n in TABLES if n not in PACKED})
    packed: dict[str, list[tuple]] = field(default_factory=lambda: {name: [] for name in PACKED})
    spans: int = 0  #: spans accepted
    rejected: int = 0  #: spans refused (invalid ids or times)
    truncated: int = 0  #: attribute values, span names and status messages cut to the length limit
    duplicates: int = 0  #: spans the store already held, so left out (set by the store's write)
    problems: list[str] = field(default_factory=list)  #: first few reasons, for the response message
    rejected_by: Counter = field(default_factory=Counter)  #: refused spans by reason
    left_out: Counter = field(default_factory=Counter)  #: typed values left out (span kept), by reason
    #: Row count of every list (``MARKED`` order) after each accepted span: the rows of span k are
    #: those between marks[k-1] and marks[k], which lets a store keep only fresh spans (once.py).
    marks: np.ndarray = field(default_factory=lambda: np.zeros((0, len(MARKED)), dtype=np.int64))

    def message(self) -> str:
        """The partial-success message: what was refused or changed, in one line."""
        return partial_success_message(self.problems, self.truncated)

    def expanded(self, table: str) -> list[tuple]:
        """Rows of ``table`` in ``TABLES`` order, packed tables expanded (the reference semantics)."""
        if table not in PACKED:
            return list(self.rows[table])
        if table == "decode_steps":
            return [(rid, inst, step, start + offset)
                    for rid, inst, start, offsets in self.packed[table] for step, offset in enumerate(offsets)]
        return [(rid, inst, t_ns, source, index, value, fingerprint)
                for rid, inst, t_ns, source, fingerprint, hashes in self.packed[table]
                for index, value in enumerate(hashes)]

    def columns(self) -> Columns:
        """The same rows as Arrow tables (collector/decoding/columns.py): what the parse stage hands on."""
        from tokentrace.collector.decoding.columns import Columns, arrow_table
        from tokentrace.collector.stores.once import key_hashes

        out = Columns(spans=self.spans, rejected=self.rejected, truncated=self.truncated,
                      duplicates=self.duplicates, problems=list(self.problems), rejected_by=Counter(self.rejected_by),
                      left_out=Counter(self.left_out))
        spans = self.rows["spans"]
        if spans:
            out.keys = key_hashes([row[0] for row in spans], [row[1] for row in spans])
        counts = np.diff(self.marks, axis=0, prepend=np.zeros((1, len(MARKED)), dtype=np.int64))
        for column, (name, rows) in enumerate(zip(MARKED, self.lists(), strict=True)):
            if not rows:
                continue
            out.tables[name] = arrow_table(name, rows)
            if len(self.marks):
                out.origin[name] = np.repeat(np.arange(len(self.marks), dtype=np.int32), counts[:, column])
            else:  # rows built by hand, with no spans to answer for (tests, benchmarks)
                out.origin[name] = np.zeros(len(rows), dtype=np.int32)
        return out

    def lists(self) -> list[list]:
        """Every row list, in ``MARKED`` order."""
        return [self.packed[name] if name in PACKED else self.rows[name] for name in MARKED]

    def extend(self, other: Batch) -> None:
        """Append another batch's rows and counts (used to group writes)."""
        offset = np.array([len(rows) for rows in self.lists()], dtype=np.int64)
        self.marks = np.vstack([self.marks, other.marks + offset])
        for name, rows in other.rows.items():
            self.rows[name].extend(rows)
        for name, rows in other.packed.items():
            self.packed[name].extend(rows)
        self.spans += other.spans
        self.duplicates += other.duplicates
        self.rejected += other.rejected
        self.truncated += other.truncated
        self.problems.extend(other.problems)
        self.rejected_by.update(other.rejected_by)
        self.left_out.update(other.left_out)

    def leave_out(self, reason: str, message: str) -> None:
        """Record a typed value (or a span's typed rows) left out: the span itself is stored."""
        self.left_out[reason] += 1
        if len(self.problems) < 10:
            self.problems.append(message)


@dataclass
class _Scope:
    """Per-ResourceSpans context shared by its spans."""

    batch: Batch
    instance_id: str | None
    service_name: str | None
    engine: str | None
    model: str | None
    max_len: int
    observer: str | None = None  #: resource tokentrace.observer, when the sender says


def normalize(request: ExportTraceServiceRequest, max_value_length: int = DEFAULT_MAX_VALUE_LENGTH) -> Batch:
    """All rows for one OTLP export request."""
    batch = Batch()
    lists, marks = batch.lists(), []
    for resource_spans in request.resource_spans:
        counter = [0]
        resource = {kv.key: _value(kv.value, max_value_length, counter) for kv in resource_spans.resource.attributes}
        scope = _Scope(
            batch, _str(resource.get(c.SERVICE_INSTANCE_ID)), _str(resource.get(c.SERVICE_NAME)),
            _str(resource.get(c.ENGINE)), _str(resource.get(c.MODEL)), max_value_length,
            _str(resource.get(c.OBSERVER)),
        )
        resource_json = _json(resource)
        seen_ns = 0
        for r_index, scope_spans in enumerate(resource_spans.scope_spans):
            scope_name = scope_spans.scope.name or None
            scope_version = scope_spans.scope.version or None
            for s_index, span in enumerate(scope_spans.spans):
                # Each field is read once: a read of a protobuf field costs 0.1-0.5 µs, a span ~25 µs.
                events, end_ns = span.events or None, span.end_time_unix_nano
                problem = _invalid(span, end_ns, events)
                if problem:
                    batch.rejected += 1
                    batch.rejected_by[problem[0]] += 1
                    batch.problems.append(f"scopeSpans[{r_index}].spans[{s_index}]: {problem[1]}")
                    continue
                _normalize_span(scope, span, end_ns, events, (scope_name, scope_version), resource_json, counter)
                batch.spans += 1
                marks.append(tuple(map(len, lists)))
                seen_ns = max(seen_ns, end_ns)
        batch.truncated += counter[0]
        if seen_ns:
            batch.rows["resources"].append((
                scope.instance_id, scope.service_name, _str(resource.get(c.HOST_NAME)),
                _str(resource.get(c.ENGINE)), _str(resource.get(c.ENGINE_VERSION)),
                _str(resource.get(c.MODEL)), seen_ns, resource_json,
            ))
            marks[-1] = tuple(map(len, lists))  # the resource row goes with its last span
    batch.marks = np.array(marks, dtype=np.int64).reshape(len(marks), len(MARKED))
    return batch


_ZERO_TRACE_ID, _ZERO_SPAN_ID = bytes(16), bytes(8)


def _invalid(span, end_ns: int, events) -> tuple[str, str] | None:
    """(reason, message) when the span must be refused; None when it can be stored."""
    trace_id, span_id = span.trace_id, span.span_id
    if len(trace_id) != 16:
        return "bad_id", f"trace_id must be 16 bytes, received {len(trace_id)}"
    if len(span_id) != 8:
        return "bad_id", f"span_id must be 8 bytes, received {len(span_id)}"
    # trace.proto: a valid id has at least one non-zero byte (the C decoder leaves these to Python).
    if trace_id == _ZERO_TRACE_ID:
        return "bad_id", "trace_id must not be all zeros (OTLP calls an all-zero trace id invalid)"
    if span_id == _ZERO_SPAN_ID:
        return "bad_id", "span_id must not be all zeros (OTLP calls an all-zero span id invalid)"
    if span.parent_span_id and len(span.parent_span_id) != 8:
        return "bad_id", f"parent_span_id must be empty or 8 bytes, received {len(span.parent_span_id)}"
    if end_ns > MAX_TIME_NS:  # end >= start is checked next, so start fits too
        return "time_out_of_range", f"end_time_unix_nano must be below 2^63 (the year 2262), received {end_ns}"
    if end_ns < span.start_time_unix_nano:
        return "end_before_start", "end_time_unix_nano is before start_time_unix_nano"
    for event in events or ():
        if event.time_unix_nano > MAX_TIME_NS:
            return "time_out_of_range", (f"event {event.name[:80]!r}: time_unix_nano must be below 2^63 (the "
                                         f"year 2262), received {event.time_unix_nano}")
    return None


def _normalize_span(scope: _Scope, span, end_ns: int, span_events, scope_id: tuple, resource_json: str,
                    counter: list) -> None:
    attrs = _attributes(span.attributes, scope.max_len, counter)
    ids = (span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex() or None)
    name = span.name
    builder = _BUILDERS.get(name) or translations.builder(name)
    if builder is not None:
        try:
            builder(scope, span, attrs, ids)
        except _Untyped as exc:  # builders raise before they append any row
            scope.batch.leave_out(exc.reason, f"span {name[:80]} {ids[1]} stored without its typed rows: {exc}")
            builder = None  # and its columnar attributes stay in spans.attributes, as sent
    events = None
    if span_events:
        events = [_event(scope, span, event, attrs, counter) for event in span_events]
    links = span.links or None
    if links:
        links = [_link(link, scope.max_len, counter) for link in links]
    stored = attrs if builder is None else {k: v for k, v in attrs.items() if k not in EXPANDED}
    status = span.status
    message = status.message
    if len(name) > scope.max_len or len(message) > scope.max_len:  # cut like attribute values
        counter[0] += (len(name) > scope.max_len) + (len(message) > scope.max_len)
        name, message = name[:scope.max_len], message[:scope.max_len]
    scope.batch.rows["spans"].append((
        *ids, name, span.kind, span.start_time_unix_nano, end_ns,
        status.code, message or None, scope.service_name, scope.instance_id, scope_id[0],
        _str(attrs.get(c.REQUEST_ID)), _json(stored), _json(events), _json(links), resource_json,
        span.trace_state or None, scope_id[1], span.dropped_attributes_count or None,
        span.dropped_events_count or None, span.dropped_links_count or None,
    ))


def _link(link, max_len: int, counter: list) -> dict:
    """A link as stored in ``spans.links``: ids always; trace state, attributes and the dropped
    attribute count when the sender set them."""
    stored = {"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex()}
    if link.trace_state:
        stored["trace_state"] = link.trace_state
    if link.attributes:
        stored["attributes"] = {kv.key: _value(kv.value, max_len, counter) for kv in link.attributes}
    if link.dropped_attributes_count:
        stored["dropped_attributes_count"] = link.dropped_attributes_count
    return stored


def _event(scope: _Scope, span, event, span_attrs: dict, counter: list) -> dict:
    attrs = {kv.key: _value(kv.value, scope.max_len, counter) for kv in event.attributes}
    t_ns = event.time_unix_nano
    if event.name == c.EVENT_CACHE_EVICT:
        scope.batch.rows["cache_evictions"].append((
            scope.instance_id, t_ns, _int_of(scope, attrs, c.ENTRY_FINGERPRINT), _int_of(scope, attrs, c.ENTRY_TOKENS),
            _int_of(scope, attrs, c.ENTRY_BYTES), _str(attrs.get(c.EVICT_REASON)),
            _str(attrs.get(c.ENTRY_REQUEST_ID)), _str(span_attrs.get(c.REQUEST_ID)),
            _int_of(scope, attrs, c.CACHE_ENTRIES), _int_of(scope, attrs, c.CACHE_BYTES), span.span_id.hex(),
        ))
    elif event.name in c.LIFECYCLE_EVENTS:
        load_id = attrs.get(c.LOAD_ID, span_attrs.get(c.LOAD_ID))
        scope.batch.rows["instance_events"].append(
            (scope.instance_id, scope.service_name, t_ns, event.name, _str(load_id), span.name)
        )
    stored = {"name": event.name, "time_ns": t_ns, "attributes": attrs}
    if event.dropped_attributes_count:
        stored["dropped_attributes_count"] = event.dropped_attributes_count
    return stored


# --- typed rows per span name ---------------------------------------------------------------------
def _request(scope: _Scope, span, a: dict, ids: tuple) -> None:
    a = v.with_both_names(a)  # legacy GenAI names too (docs/telemetry.md, "OpenTelemetry GenAI conventions")
    reasons = a.get(c.FINISH_REASONS)
    finish = reasons[0] if isinstance(reasons, list) and reasons else _str(reasons)
    scope.batch.rows["requests"].append((
        _str(a.get(c.REQUEST_ID)) or ids[1], ids[0], ids[1], scope.instance_id, scope.service_name,
        scope.engine, _str(a.get(c.MODEL)) or scope.model, _str(a.get(c.SESSION_ID)), _str(a.get(c.ENDPOINT)),
        span.start_time_unix_nano, span.end_time_unix_nano,
        _ms(scope, a, c.QUEUE_MS), _ms(scope, a, c.LOAD_WAIT_MS), _ms(scope, a, c.PREFILL_MS),
        _ms(scope, a, c.DECODE_MS), _ms(scope, a, c.TTFT_MS), _ms(scope, a, c.TPOT_MS),
        _int(a.get(c.INPUT_TOKENS)), _int(a.get(c.CACHED_TOKENS)), _int(a.get(c.OUTPUT_TOKENS)),
        _int(a.get(c.MAX_TOKENS)), finish, _bool(a.get(c.STREAMED)), _bool(a.get(c.CLIENT_DISCONNECTED)),
        _int(a.get(c.HTTP_STATUS)), _str(a.get(c.ERROR_TYPE)), _ms(scope, a, c.FIRST_CONTENT_MS),
        _observer(scope), _str(a.get(c.UPSTREAM_EVIDENCE)),
    ))


def _observer(scope: _Scope) -> str:
    """Who observed a contract ``llm.request``: the resource says so (the gateway does); otherwise
    the vLLM plugin for a vLLM resource, a tokentrace engine for anything else."""
    if scope.observer:
        return scope.observer
    return c.OBSERVER_PLUGIN if scope.engine == c.ENGINE_VLLM else c.OBSERVER_ENGINE


def _route(scope: _Scope, span, a: dict, ids: tuple) -> None:
    scope.batch.rows["routes"].append((
        _str(a.get(c.REQUEST_ID)), ids[0], ids[1], scope.instance_id or _str(a.get(c.ROUTE_CHOICE)),
        _str(a.get(c.SESSION_ID)), span.start_time_unix_nano, span.end_time_unix_nano,
        _str(a.get(c.ROUTE_POLICY)), _str(a.get(c.ROUTE_REASON)), [_str(x) for x in _list(a.get(c.ROUTE_CANDIDATES))],
        [float(x) for x in _list(a.get(c.ROUTE_SCORES)) if isinstance(x, (int, float)) and not isinstance(x, bool)],
        _int(a.get(c.ROUTE_ATTEMPTS)), [_str(x) for x in _list(a.get(c.ROUTE_SKIPPED))],
        _ms(scope, a, c.GATEWAY_WAIT_MS), _int(a.get(c.AVOIDABLE_PREFILL)), _str(a.get(c.AVOIDABLE_FROM)),
    ))


def _phase(scope: _Scope, span, a: dict, ids: tuple) -> None:
    scope.batch.rows["phases"].append((
        _str(a.get(c.REQUEST_ID)), scope.instance_id, span.name, span.start_time_unix_nano,
        span.end_time_unix_nano, _int(a.get(c.QUEUE_DEPTH)), _int(a.get(c.QUEUE_RUNNING)),
        _int(a.get(c.MAX_BATCH)), _str(a.get(c.LOAD_ID)),
    ))


def _decode(scope: _Scope, span, a: dict, ids: tuple) -> None:
    offsets = _column(a, c.DECODE_STEP_OFFSETS)
    if offsets and (min(offsets) < 0 or span.start_time_unix_nano + max(offsets) > MAX_TIME_NS):
        raise _Untyped("offset_out_of_range", f"{c.DECODE_STEP_OFFSETS} must be offsets from the span's start "
                                              f"within 0..2^63 ns, received {min(offsets)}..{max(offsets)}")
    _phase(scope, span, a, ids)
    if offsets:
        scope.batch.packed["decode_steps"].append(
            (_str(a.get(c.REQUEST_ID)), scope.instance_id, span.start_time_unix_nano, offsets))


def _chunk(scope: _Scope, span, a: dict, ids: tuple) -> None:
    scope.batch.rows["prefill_chunks"].append((
        _str(a.get(c.REQUEST_ID)), scope.instance_id, span.start_time_unix_nano, span.end_time_unix_nano,
        _int(a.get(c.CHUNK_OFFSET)), _int(a.get(c.CHUNK_TOKENS)), _int(a.get(c.CHUNK_BATCH_SIZE)),
    ))


def _blocks(scope: _Scope, rid: str | None, t_ns: int, source: str, hashes: list, fingerprint: int | None) -> None:
    if hashes:
        scope.batch.packed["prefix_blocks"].append((rid, scope.instance_id, t_ns, source, fingerprint, hashes))


def _lookup(scope: _Scope, span, a: dict, ids: tuple) -> None:
    hashes, starts, ends = _column(a, c.CACHE_BLOCK_HASHES), _column(a, c.SEGMENT_STARTS), _column(a, c.SEGMENT_ENDS)
    segment_hashes, tails = _column(a, c.SEGMENT_HASHES), _column(a, c.SEGMENT_TAIL_HASHES)
    _phase(scope, span, a, ids)
    rid, t_ns = _str(a.get(c.REQUEST_ID)), span.start_time_unix_nano
    scope.batch.rows["cache_lookups"].append((
        rid, scope.instance_id, t_ns, span.end_time_unix_nano, _int(a.get(c.CACHE_PROMPT_TOKENS)),
        _int(a.get(c.CACHE_MATCHED_TOKENS)), _str(a.get(c.CACHE_MATCH)), _int(a.get(c.CACHE_MATCHED_ENTRY)),
        _int(a.get(c.CACHE_ENTRIES)), _int(a.get(c.CACHE_BYTES)), _int(a.get(c.CACHE_BLOCK_SIZE)),
        _str(a.get(c.CACHE_UNIT)),
    ))
    _blocks(scope, rid, t_ns, "lookup", hashes, None)
    roles, snippets = _list(a.get(c.SEGMENT_ROLES)), _list(a.get(c.SEGMENT_SNIPPETS))
    scope.batch.rows["segments"].extend(
        (rid, scope.instance_id, t_ns, i, _str(role), _at(starts, i), _at(ends, i), _at(segment_hashes, i),
         _str(_at(snippets, i)), _at(tails, i) or None)
        for i, role in enumerate(roles)
    )


def _insert(scope: _Scope, span, a: dict, ids: tuple) -> None:
    hashes = _column(a, c.CACHE_BLOCK_HASHES)
    _phase(scope, span, a, ids)
    rid, fingerprint = _str(a.get(c.REQUEST_ID)), _int(a.get(c.ENTRY_FINGERPRINT))
    scope.batch.rows["cache_inserts"].append((
        rid, scope.instance_id, span.start_time_unix_nano, span.end_time_unix_nano, fingerprint,
        _int(a.get(c.ENTRY_TOKENS)), _int(a.get(c.ENTRY_BYTES)), _int(a.get(c.CACHE_BLOCK_SIZE)),
        _int(a.get(c.CACHE_ENTRIES)), _int(a.get(c.CACHE_BYTES)), _int(a.get(c.CACHE_MAX_ENTRIES)),
        _int(a.get(c.CACHE_MAX_BYTES)), _rank(a.get(c.CACHE_LIMIT_RANK)),
    ))
    _blocks(scope, rid, span.start_time_unix_nano, "insert", hashes, fingerprint)


def _model_load(scope: _Scope, span, a: dict, ids: tuple) -> None:
    scope.batch.rows["model_loads"].append((
        _str(a.get(c.LOAD_ID)) or ids[1], scope.instance_id, ids[0], ids[1], span.start_time_unix_nano,
        span.end_time_unix_nano, _bool(a.get(c.LOAD_LAZY)), _str(a.get(c.MODEL_PATH)),
    ))


def _load_stage(scope: _Scope, span, a: dict, ids: tuple) -> None:
    scope.batch.rows["load_stages"].append((
        _str(a.get(c.LOAD_ID)), scope.instance_id, *ids, span.name, span.start_time_unix_nano,
        span.end_time_unix_nano, _int(a.get(c.LOAD_BYTES)),
    ))


def _steps(scope: _Scope, span, a: dict, ids: tuple) -> None:
    starts, durations = _column(a, c.STEPS_START_OFFSETS), _column(a, c.STEPS_DURATIONS)
    prefill_seqs, decode_seqs = _column(a, c.STEPS_PREFILL_SEQS), _column(a, c.STEPS_DECODE_SEQS)
    prefill_tokens, decode_tokens = _column(a, c.STEPS_PREFILL_TOKENS), _column(a, c.STEPS_DECODE_TOKENS)
    names, members = _list(a.get(c.STEPS_REQUESTS)), _column(a, c.STEPS_MEMBERS)
    compute, ring_wait = _column(a, c.STEPS_COMPUTE), _column(a, c.STEPS_RING_WAIT)
    ring_wait_cpu = _column(a, c.STEPS_RING_WAIT_CPU)
    origin, cursor, rows = span.start_time_unix_nano, 0, scope.batch.rows["steps"]
    _check_steps(origin, starts, prefill_seqs[:len(starts)] + decode_seqs[:len(starts)], members, len(names))
    for i, offset in enumerate(starts):
        n_prefill, n_decode = _at(prefill_seqs, i) or 0, _at(decode_seqs, i) or 0
        picked = [_str(_at(names, m)) for m in members[cursor : cursor + n_prefill + n_decode]]
        cursor += n_prefill + n_decode
        rows.append((
            scope.instance_id, origin + offset, _at(durations, i), n_prefill, n_decode,
            _at(prefill_tokens, i), _at(decode_tokens, i), picked[:n_prefill], picked[n_prefill:],
            _timed(_at(compute, i)), _timed(_at(ring_wait, i)), _timed(_at(ring_wait_cpu, i)),
        ))


def _timed(value: int | None) -> int | None:
    """A rank's per-step timing: None where it did not time the step (-1)."""
    return value if value is not None and value >= 0 else None


def _check_steps(origin: int, starts: list[int], counts: list[int], members: list[int], names: int) -> None:
    """Raise _Untyped unless the step arrays can be expanded: offsets within the store's time range,
    sequence counts non-negative, members indexing the request ids (a sender may leave members out,
    as vLLM does: its rows then name no requests)."""
    if starts and (min(starts) < 0 or origin + max(starts) > MAX_TIME_NS):
        raise _Untyped("offset_out_of_range", f"{c.STEPS_START_OFFSETS} must be offsets from the span's start "
                                              f"within 0..2^63 ns, received {min(starts)}..{max(starts)}")
    if counts and min(counts) < 0:
        raise _Untyped("steps_invalid", f"sequence counts per step must be 0 or more, received {min(counts)}")
    if members and (min(members) < 0 or max(members) >= names):
        raise _Untyped("steps_invalid", f"{c.STEPS_MEMBERS} must index {c.STEPS_REQUESTS} (0..{names - 1}), "
                                        f"received {min(members)}..{max(members)}")


def _heartbeat(scope: _Scope, span, a: dict, ids: tuple) -> None:
    scope.batch.rows["heartbeats"].append((
        scope.instance_id, span.end_time_unix_nano, _int(a.get(c.QUEUE_DEPTH)), _int(a.get(c.QUEUE_RUNNING)),
        _int(a.get(c.MAX_BATCH)), _int(a.get(c.CACHE_ENTRIES)), _int(a.get(c.CACHE_BYTES)),
        _int(a.get(c.CACHE_MAX_ENTRIES)), _int(a.get(c.CACHE_MAX_BYTES)), _int(a.get(c.KV_BYTES_PER_TOKEN)),
        _int(a.get(c.MEMORY_BYTES)), _str(a.get(c.CACHE_UNIT)), _int(a.get(c.MEMORY_FREE)),
    ))


_Builder = Callable[[_Scope, object, dict, tuple], None]
_BUILDERS: dict[str, _Builder] = {
    c.SPAN_REQUEST: _request,
    c.SPAN_QUEUE: _phase,
    c.SPAN_LOAD_WAIT: _phase,
    c.SPAN_PREFILL: _phase,
    c.SPAN_DECODE: _decode,
    c.SPAN_PREFILL_CHUNK: _chunk,
    c.SPAN_CACHE_LOOKUP: _lookup,
    c.SPAN_CACHE_INSERT: _insert,
    c.SPAN_MODEL_LOAD: _model_load,
    c.SPAN_LOAD_RESOLVE: _load_stage,
    c.SPAN_LOAD_WEIGHTS: _load_stage,
    c.SPAN_LOAD_TOKENIZER: _load_stage,
    c.SPAN_LOAD_WARMUP: _load_stage,
    c.SPAN_LOAD_GROUP: _load_stage,
    c.SPAN_LOAD_SHARD: _load_stage,
    c.SPAN_ENGINE_STEPS: _steps,
    c.SPAN_HEARTBEAT: _heartbeat,
    c.SPAN_ROUTE: _route,
}


# --- values ---------------------------------------------------------------------------------------
_SCALARS = frozenset({"int_value", "double_value", "bool_value"})


def _attributes(pairs, max_len: int, counter: list) -> dict:
    """A span's attributes as a dict of Python values: ``_value`` of each, with the scalar kinds
    read in the loop (a function call per attribute was a tenth of the normalizer's time)."""
    attrs = {}
    for kv in pairs:
        v = kv.value
        kind = v.WhichOneof("value")
        if kind == "string_value":
            text = v.string_value
            if len(text) > max_len:
                counter[0] += 1
                text = text[:max_len]
            attrs[kv.key] = text
        elif kind in _SCALARS:
            attrs[kv.key] = getattr(v, kind)
        else:
            attrs[kv.key] = _value(v, max_len, counter)
    return attrs


def _value(v, max_len: int, counter: list):
    """An AnyValue as a Python value; strings longer than ``max_len`` are cut (and counted)."""
    kind = v.WhichOneof("value")
    if kind == "string_value":
        text = v.string_value
        if len(text) > max_len:
            counter[0] += 1
            return text[:max_len]
        return text
    if kind == "array_value":
        return _array(v.array_value.values, max_len, counter)
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value, max_len, counter) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return base64.b64encode(v.bytes_value[:max_len]).decode("ascii")
    if kind is None:
        return None
    return getattr(v, kind)


def _array(values, max_len: int, counter: list) -> list:
    # Reading one field per element keeps the columnar arrays (offsets, hashes) fast. An element of
    # another kind reads as 0 that way, so only zeros get a second look: a mixed array such as
    # [1, "s", 2.5] is legal OTLP (common.proto) and is kept as sent.
    if not values:
        return []
    kind = values[0].WhichOneof("value")
    if kind == "int_value":
        read = [x.int_value for x in values]
    elif kind == "double_value":
        read = [x.double_value for x in values]
    else:
        return [_value(x, max_len, counter) for x in values]
    at = -1
    for _ in range(read.count(0)):  # list.count and list.index scan in C; only zeros cost a step
        at = read.index(0, at + 1)
        if values[at].WhichOneof("value") != kind:
            return [_value(x, max_len, counter) for x in values]
    return read


def _json(value) -> str | None:
    if not value:
        return None
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:  # NaN or an infinity: JSON has none, so they are written as OTLP JSON does
        return json.dumps(_finite(value), separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _finite(value):
    """NaN and infinities as the strings "NaN", "Infinity", "-Infinity" (the proto3 JSON mapping of
    a double, which OTLP JSON uses), everywhere inside ``value``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def _str(value) -> str | None:
    if value is None or value == "":
        return None
    return value if isinstance(value, str) else str(value)


def _int(value) -> int | None:
    """A 64-bit integer, or None (bools, non-integral numbers, anything else)."""
    if type(value) is int:  # AnyValue.int_value: always 64-bit
        return value
    if isinstance(value, float) and value.is_integer() and _INT64[0] <= value <= _INT64[1]:
        return int(value)
    return None


def _rank(value) -> int | None:
    """A rank: an integer attribute (int_value, not a bool or an integral double) of 0 or more, else
    None. The attribute is kept in ``spans.attributes`` as sent either way."""
    return value if type(value) is int and value >= 0 else None


def _int_of(scope: _Scope, a: dict, key: str) -> int | None:
    """``_int`` of attribute ``key``; a value present but not a 64-bit integer is left out, counted."""
    value = a.get(key)
    typed = _int(value)
    if typed is None and value is not None:
        scope.batch.leave_out("invalid_value", f"{key} must be a 64-bit integer, received {_shown(value)}")
    return typed


def _ms(scope: _Scope, a: dict, key: str, scale: float = 1.0) -> float | None:
    """A duration summary in ms (attribute ``key`` times ``scale``), when finite and within
    0..MAX_MS; otherwise left out (counted): NaN, infinities or 1e308 must never reach a verdict."""
    value = a.get(key)
    if value is None:
        return None
    if type(value) is float or type(value) is int:
        ms = value * scale
        if 0.0 <= ms <= MAX_MS:  # False for NaN
            return float(ms)
    scope.batch.leave_out("invalid_value", f"{key} must be a duration within 0..{MAX_MS / scale:g} "
                                           f"{'s' if scale != 1.0 else 'ms'}, received {_shown(value)}")
    return None


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_INT_ONLY = {int}


def _column(a: dict, key: str) -> list[int]:
    """A columnar integer attribute (offsets, hashes, per-step counts); [] when absent. Any other
    value makes the span's typed rows impossible (_Untyped): its elements would not line up."""
    value = a.get(key)
    if value is None:
        return []
    if isinstance(value, list) and (not value or set(map(type, value)) == _INT_ONLY):  # map and set run in C
        return value
    raise _Untyped("column_invalid", f"{key} must be an array of 64-bit integers, received {_shown(value)}")


def _bool(value) -> bool | None:
    return value if isinstance(value, bool) else None


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _at(values: list, index: int):
    return values[index] if 0 <= index < len(values) else None


# --- for engine translations (tokentrace.engine_shim.translations) ---------------------------------
#: A translation's builder gets the same scope and reads values with the normalizer's own rules.
Scope = _Scope
as_str, as_int, as_ms = _str, _int, _ms
