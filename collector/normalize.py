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
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace import contract as c
from tokentrace.engine_shim import translations

TABLES: dict[str, tuple[str, ...]] = {
    "spans": (
        "trace_id", "span_id", "parent_span_id", "name", "kind", "start_ns", "end_ns", "status_code",
        "status_message", "service_name", "instance_id", "scope_name", "request_id", "attributes",
        "events", "links", "resource",
    ),
    "resources": (
        "instance_id", "service_name", "host_name", "engine", "engine_version", "model", "seen_ns",
        "attributes",
    ),
    "requests": (
        "request_id", "trace_id", "span_id", "instance_id", "service_name", "engine", "model",
        "session_id", "endpoint", "start_ns", "end_ns", "queue_ms", "load_wait_ms", "prefill_ms",
        "decode_ms", "ttft_ms", "tpot_ms", "prompt_tokens", "cached_tokens", "completion_tokens",
        "max_tokens", "finish_reason", "streamed", "client_disconnected", "http_status", "error_type",
        "observer", "upstream_evidence",
    ),
    "routes": (
        "request_id", "trace_id", "span_id", "instance_id", "session_id", "start_ns", "end_ns", "policy",
        "reason", "candidates", "scores", "attempts", "skipped", "gateway_wait_ms", "avoidable_prefill_tokens",
        "avoidable_from",
    ),
    "phases": (
        "request_id", "instance_id", "trace_id", "span_id", "parent_span_id", "name", "start_ns",
        "end_ns", "queue_depth", "queue_running", "max_batch", "load_id",
    ),
    "prefill_chunks": (
        "request_id", "instance_id", "start_ns", "end_ns", "chunk_offset", "tokens", "batch_size",
    ),
    "decode_steps": ("request_id", "instance_id", "step", "t_ns"),
    "steps": (
        "instance_id", "start_ns", "duration_ns", "prefill_seqs", "decode_seqs", "prefill_tokens",
        "decode_tokens", "prefill_request_ids", "decode_request_ids",
    ),
    "cache_lookups": (
        "request_id", "instance_id", "start_ns", "end_ns", "prompt_tokens", "matched_tokens", "match",
        "matched_entry", "cache_entries", "cache_bytes", "block_size", "cache_unit",
    ),
    "prefix_blocks": ("request_id", "instance_id", "t_ns", "source", "block_index", "hash", "fingerprint"),
    "segments": (
        "request_id", "instance_id", "t_ns", "segment_index", "role", "token_start", "token_end",
        "hash", "snippet",
    ),
    "cache_inserts": (
        "request_id", "instance_id", "start_ns", "end_ns", "fingerprint", "tokens", "bytes",
        "block_size", "cache_entries", "cache_bytes", "max_entries", "max_bytes",
    ),
    "cache_evictions": (
        "instance_id", "t_ns", "fingerprint", "tokens", "bytes", "reason", "entry_request_id",
        "evicted_by_request_id", "cache_entries", "cache_bytes", "span_id",
    ),
    "instance_events": ("instance_id", "service_name", "t_ns", "event", "load_id", "span_name"),
    "model_loads": ("load_id", "instance_id", "trace_id", "span_id", "start_ns", "end_ns", "lazy", "model_path"),
    "load_stages": (
        "load_id", "instance_id", "trace_id", "span_id", "parent_span_id", "name", "start_ns", "end_ns",
        "bytes",
    ),
    "heartbeats": (
        "instance_id", "t_ns", "queue_depth", "running", "max_batch", "cache_entries", "cache_bytes",
        "cache_max_entries", "cache_max_bytes", "kv_bytes_per_token", "memory_bytes", "cache_unit",
    ),
}

#: Packed forms of the per-token/per-block tables: the last column is a list, one element per row.
#: decode_steps: step = list index, t_ns = start_ns + offset. prefix_blocks: block_index = list
#: index, hash = element.
PACKED: dict[str, tuple[str, ...]] = {
    "decode_steps": ("request_id", "instance_id", "start_ns", "offsets"),
    "prefix_blocks": ("request_id", "instance_id", "t_ns", "source", "fingerprint", "hashes"),
}

#: Attributes expanded into typed rows and therefore not repeated in ``spans.attributes``.
EXPANDED = frozenset({
    c.CACHE_BLOCK_HASHES, c.DECODE_STEP_OFFSETS, c.SEGMENT_ROLES, c.SEGMENT_STARTS, c.SEGMENT_ENDS,
    c.SEGMENT_HASHES, c.SEGMENT_SNIPPETS, c.STEPS_START_OFFSETS, c.STEPS_DURATIONS,
    c.STEPS_PREFILL_SEQS, c.STEPS_DECODE_SEQS, c.STEPS_PREFILL_TOKENS, c.STEPS_DECODE_TOKENS,
    c.STEPS_REQUESTS, c.STEPS_MEMBERS,
})

DEFAULT_MAX_VALUE_LENGTH = 65_536


@dataclass
class Batch:
    """Rows for every table (lists of tuples in ``TABLES`` column order) plus what was refused."""

    rows: dict[str, list[tuple]] = field(default_factory=lambda: {n: [] for n in TABLES if n not in PACKED})
    packed: dict[str, list[tuple]] = field(default_factory=lambda: {name: [] for name in PACKED})
    spans: int = 0  #: spans accepted
    rejected: int = 0  #: spans refused (invalid ids or times)
    truncated: int = 0  #: attribute values cut to the length limit
    problems: list[str] = field(default_factory=list)  #: first few reasons, for the response message

    def message(self) -> str:
        """The partial-success message: what was refused or changed, in one line."""
        parts = list(self.problems[:3])
        if len(self.problems) > 3:
            parts.append(f"and {len(self.problems) - 3} more")
        if self.truncated:
            parts.append(f"{self.truncated} attribute values were truncated to the length limit")
        return "; ".join(parts)

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

    def extend(self, other: Batch) -> None:
        """Append another batch's rows and counts (used to group writes)."""
        for name, rows in other.rows.items():
            self.rows[name].extend(rows)
        for name, rows in other.packed.items():
            self.packed[name].extend(rows)
        self.spans += other.spans
        self.rejected += other.rejected
        self.truncated += other.truncated
        self.problems.extend(other.problems)


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
            for s_index, span in enumerate(scope_spans.spans):
                problem = _invalid(span)
                if problem:
                    batch.rejected += 1
                    batch.problems.append(f"scopeSpans[{r_index}].spans[{s_index}]: {problem}")
                    continue
                _normalize_span(scope, span, scope_name, resource_json, counter)
                batch.spans += 1
                seen_ns = max(seen_ns, span.end_time_unix_nano)
        batch.truncated += counter[0]
        if seen_ns:
            batch.rows["resources"].append((
                scope.instance_id, scope.service_name, _str(resource.get(c.HOST_NAME)),
                _str(resource.get(c.ENGINE)), _str(resource.get(c.ENGINE_VERSION)),
                _str(resource.get(c.MODEL)), seen_ns, resource_json,
            ))
    return batch


def _invalid(span) -> str:
    if len(span.trace_id) != 16:
        return f"trace_id must be 16 bytes, received {len(span.trace_id)}"
    if len(span.span_id) != 8:
        return f"span_id must be 8 bytes, received {len(span.span_id)}"
    if span.parent_span_id and len(span.parent_span_id) != 8:
        return f"parent_span_id must be empty or 8 bytes, received {len(span.parent_span_id)}"
    if span.end_time_unix_nano < span.start_time_unix_nano:
        return "end_time_unix_nano is before start_time_unix_nano"
    return ""


def _normalize_span(scope: _Scope, span, scope_name: str | None, resource_json: str, counter: list) -> None:
    attrs = {kv.key: _value(kv.value, scope.max_len, counter) for kv in span.attributes}
    ids = (span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex() or None)
    builder = _BUILDERS.get(span.name) or translations.builder(span.name)
    if builder is not None:
        builder(scope, span, attrs, ids)
    events = None
    if span.events:
        events = [_event(scope, span, event, attrs, counter) for event in span.events]
    links = None
    if span.links:
        links = [{"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex()} for link in span.links]
    stored = attrs if builder is None else {k: v for k, v in attrs.items() if k not in EXPANDED}
    scope.batch.rows["spans"].append((
        *ids, span.name, span.kind, span.start_time_unix_nano, span.end_time_unix_nano,
        span.status.code, span.status.message or None, scope.service_name, scope.instance_id, scope_name,
        _str(attrs.get(c.REQUEST_ID)), _json(stored), _json(events), _json(links), resource_json,
    ))


def _event(scope: _Scope, span, event, span_attrs: dict, counter: list) -> dict:
    attrs = {kv.key: _value(kv.value, scope.max_len, counter) for kv in event.attributes}
    t_ns = event.time_unix_nano
    if event.name == c.EVENT_CACHE_EVICT:
        scope.batch.rows["cache_evictions"].append((
            scope.instance_id, t_ns, attrs.get(c.ENTRY_FINGERPRINT), attrs.get(c.ENTRY_TOKENS),
            attrs.get(c.ENTRY_BYTES), _str(attrs.get(c.EVICT_REASON)), _str(attrs.get(c.ENTRY_REQUEST_ID)),
            _str(span_attrs.get(c.REQUEST_ID)), attrs.get(c.CACHE_ENTRIES), attrs.get(c.CACHE_BYTES),
            span.span_id.hex(),
        ))
    elif event.name in c.LIFECYCLE_EVENTS:
        load_id = attrs.get(c.LOAD_ID, span_attrs.get(c.LOAD_ID))
        scope.batch.rows["instance_events"].append(
            (scope.instance_id, scope.service_name, t_ns, event.name, _str(load_id), span.name)
        )
    return {"name": event.name, "time_ns": t_ns, "attributes": attrs}


# --- typed rows per span name ---------------------------------------------------------------------
def _request(scope: _Scope, span, a: dict, ids: tuple) -> None:
    reasons = a.get(c.FINISH_REASONS)
    finish = reasons[0] if isinstance(reasons, list) and reasons else _str(reasons)
    scope.batch.rows["requests"].append((
        _str(a.get(c.REQUEST_ID)) or ids[1], ids[0], ids[1], scope.instance_id, scope.service_name,
        scope.engine, _str(a.get(c.MODEL)) or scope.model, _str(a.get(c.SESSION_ID)), _str(a.get(c.ENDPOINT)),
        span.start_time_unix_nano, span.end_time_unix_nano,
        _num(a.get(c.QUEUE_MS)), _num(a.get(c.LOAD_WAIT_MS)), _num(a.get(c.PREFILL_MS)),
        _num(a.get(c.DECODE_MS)), _num(a.get(c.TTFT_MS)), _num(a.get(c.TPOT_MS)),
        _int(a.get(c.INPUT_TOKENS)), _int(a.get(c.CACHED_TOKENS)), _int(a.get(c.OUTPUT_TOKENS)),
        _int(a.get(c.MAX_TOKENS)), finish, _bool(a.get(c.STREAMED)), _bool(a.get(c.CLIENT_DISCONNECTED)),
        _int(a.get(c.HTTP_STATUS)), _str(a.get(c.ERROR_TYPE)), _observer(scope), _str(a.get(c.UPSTREAM_EVIDENCE)),
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
        _num(a.get(c.GATEWAY_WAIT_MS)), _int(a.get(c.AVOIDABLE_PREFILL)), _str(a.get(c.AVOIDABLE_FROM)),
    ))


def _phase(scope: _Scope, span, a: dict, ids: tuple) -> None:
    scope.batch.rows["phases"].append((
        _str(a.get(c.REQUEST_ID)), scope.instance_id, *ids, span.name, span.start_time_unix_nano,
        span.end_time_unix_nano, _int(a.get(c.QUEUE_DEPTH)), _int(a.get(c.QUEUE_RUNNING)),
        _int(a.get(c.MAX_BATCH)), _str(a.get(c.LOAD_ID)),
    ))


def _decode(scope: _Scope, span, a: dict, ids: tuple) -> None:
    _phase(scope, span, a, ids)
    offsets = _ints(a.get(c.DECODE_STEP_OFFSETS))
    if offsets:
        scope.batch.packed["decode_steps"].append(
            (_str(a.get(c.REQUEST_ID)), scope.instance_id, span.start_time_unix_nano, offsets))


def _chunk(scope: _Scope, span, a: dict, ids: tuple) -> None:
    scope.batch.rows["prefill_chunks"].append((
        _str(a.get(c.REQUEST_ID)), scope.instance_id, span.start_time_unix_nano, span.end_time_unix_nano,
        _int(a.get(c.CHUNK_OFFSET)), _int(a.get(c.CHUNK_TOKENS)), _int(a.get(c.CHUNK_BATCH_SIZE)),
    ))


def _blocks(scope: _Scope, rid: str | None, t_ns: int, source: str, a: dict, fingerprint: int | None) -> None:
    hashes = _ints(a.get(c.CACHE_BLOCK_HASHES))
    if hashes:
        scope.batch.packed["prefix_blocks"].append((rid, scope.instance_id, t_ns, source, fingerprint, hashes))


def _lookup(scope: _Scope, span, a: dict, ids: tuple) -> None:
    _phase(scope, span, a, ids)
    rid, t_ns = _str(a.get(c.REQUEST_ID)), span.start_time_unix_nano
    scope.batch.rows["cache_lookups"].append((
        rid, scope.instance_id, t_ns, span.end_time_unix_nano, _int(a.get(c.CACHE_PROMPT_TOKENS)),
        _int(a.get(c.CACHE_MATCHED_TOKENS)), _str(a.get(c.CACHE_MATCH)), _int(a.get(c.CACHE_MATCHED_ENTRY)),
        _int(a.get(c.CACHE_ENTRIES)), _int(a.get(c.CACHE_BYTES)), _int(a.get(c.CACHE_BLOCK_SIZE)),
        _str(a.get(c.CACHE_UNIT)),
    ))
    _blocks(scope, rid, t_ns, "lookup", a, None)
    roles, starts, ends = _list(a.get(c.SEGMENT_ROLES)), _ints(a.get(c.SEGMENT_STARTS)), _ints(a.get(c.SEGMENT_ENDS))
    hashes, snippets = _ints(a.get(c.SEGMENT_HASHES)), _list(a.get(c.SEGMENT_SNIPPETS))
    scope.batch.rows["segments"].extend(
        (rid, scope.instance_id, t_ns, i, _str(role), _at(starts, i), _at(ends, i), _at(hashes, i),
         _str(_at(snippets, i)))
        for i, role in enumerate(roles)
    )


def _insert(scope: _Scope, span, a: dict, ids: tuple) -> None:
    _phase(scope, span, a, ids)
    rid, fingerprint = _str(a.get(c.REQUEST_ID)), _int(a.get(c.ENTRY_FINGERPRINT))
    scope.batch.rows["cache_inserts"].append((
        rid, scope.instance_id, span.start_time_unix_nano, span.end_time_unix_nano, fingerprint,
        _int(a.get(c.ENTRY_TOKENS)), _int(a.get(c.ENTRY_BYTES)), _int(a.get(c.CACHE_BLOCK_SIZE)),
        _int(a.get(c.CACHE_ENTRIES)), _int(a.get(c.CACHE_BYTES)), _int(a.get(c.CACHE_MAX_ENTRIES)),
        _int(a.get(c.CACHE_MAX_BYTES)),
    ))
    _blocks(scope, rid, span.start_time_unix_nano, "insert", a, fingerprint)


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
    starts, durations = _ints(a.get(c.STEPS_START_OFFSETS)), _ints(a.get(c.STEPS_DURATIONS))
    prefill_seqs, decode_seqs = _ints(a.get(c.STEPS_PREFILL_SEQS)), _ints(a.get(c.STEPS_DECODE_SEQS))
    prefill_tokens, decode_tokens = _ints(a.get(c.STEPS_PREFILL_TOKENS)), _ints(a.get(c.STEPS_DECODE_TOKENS))
    names, members = _list(a.get(c.STEPS_REQUESTS)), _ints(a.get(c.STEPS_MEMBERS))
    origin, cursor, rows = span.start_time_unix_nano, 0, scope.batch.rows["steps"]
    for i, offset in enumerate(starts):
        n_prefill, n_decode = _at(prefill_seqs, i) or 0, _at(decode_seqs, i) or 0
        picked = [_str(_at(names, m)) for m in members[cursor : cursor + n_prefill + n_decode]]
        cursor += n_prefill + n_decode
        rows.append((
            scope.instance_id, origin + offset, _at(durations, i), n_prefill, n_decode,
            _at(prefill_tokens, i), _at(decode_tokens, i), picked[:n_prefill], picked[n_prefill:],
        ))


def _heartbeat(scope: _Scope, span, a: dict, ids: tuple) -> None:
    scope.batch.rows["heartbeats"].append((
        scope.instance_id, span.end_time_unix_nano, _int(a.get(c.QUEUE_DEPTH)), _int(a.get(c.QUEUE_RUNNING)),
        _int(a.get(c.MAX_BATCH)), _int(a.get(c.CACHE_ENTRIES)), _int(a.get(c.CACHE_BYTES)),
        _int(a.get(c.CACHE_MAX_ENTRIES)), _int(a.get(c.CACHE_MAX_BYTES)), _int(a.get(c.KV_BYTES_PER_TOKEN)),
        _int(a.get(c.MEMORY_BYTES)), _str(a.get(c.CACHE_UNIT)),
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
    c.SPAN_ENGINE_STEPS: _steps,
    c.SPAN_HEARTBEAT: _heartbeat,
    c.SPAN_ROUTE: _route,
}


# --- values ---------------------------------------------------------------------------------------
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
    # OTLP arrays are homogeneous (common.proto: "array of primitive values ... of the same type");
    # reading one field per element keeps the columnar arrays (offsets, hashes) fast.
    if not values:
        return []
    kind = values[0].WhichOneof("value")
    if kind == "int_value":
        return [x.int_value for x in values]
    if kind == "double_value":
        return [x.double_value for x in values]
    return [_value(x, max_len, counter) for x in values]


def _json(value) -> str | None:
    if not value:
        return None
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _str(value) -> str | None:
    if value is None or value == "":
        return None
    return value if isinstance(value, str) else str(value)


def _int(value) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _num(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _bool(value) -> bool | None:
    return value if isinstance(value, bool) else None


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _ints(value) -> list[int]:
    if isinstance(value, list) and all(type(x) is int for x in value):
        return value
    return [x for x in _list(value) if isinstance(x, int) and not isinstance(x, bool)]


def _at(values: list, index: int):
    return values[index] if index < len(values) else None


# --- for engine translations (tokentrace.engine_shim.translations) ---------------------------------
#: A translation's builder gets the same scope and reads values with the normalizer's own rules.
Scope = _Scope
as_str, as_int, as_num = _str, _int, _num
