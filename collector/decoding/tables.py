"""Column order of every table (``TABLES``; it matches the DDL, tests/test_collector_ingest.py) and the
packed forms of the per-token and per-block tables (``PACKED``): the normalizer writes rows in this
order, and a store checks a file's columns against it. A module of its own, importing nothing, so
that reading a store (``tokentrace analyze --db``) needs neither the normalizer nor numpy (issue 17).
"""

from __future__ import annotations

TABLES: dict[str, tuple[str, ...]] = {
    "spans": (
        "trace_id", "span_id", "parent_span_id", "name", "kind", "start_ns", "end_ns", "status_code",
        "status_message", "service_name", "instance_id", "scope_name", "request_id", "attributes",
        "events", "links", "resource", "trace_state", "scope_version", "dropped_attributes_count",
        "dropped_events_count", "dropped_links_count",
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
        "first_content_ms", "observer", "upstream_evidence",
    ),
    "routes": (
        "request_id", "trace_id", "span_id", "instance_id", "session_id", "start_ns", "end_ns", "policy",
        "reason", "candidates", "scores", "attempts", "skipped", "gateway_wait_ms", "avoidable_prefill_tokens",
        "avoidable_from",
    ),
    "phases": (
        "request_id", "instance_id", "name", "start_ns", "end_ns", "queue_depth", "queue_running",
        "max_batch", "load_id",
    ),
    "prefill_chunks": (
        "request_id", "instance_id", "start_ns", "end_ns", "chunk_offset", "tokens", "batch_size",
    ),
    "decode_steps": ("request_id", "instance_id", "step", "t_ns"),
    "steps": (
        "instance_id", "start_ns", "duration_ns", "prefill_seqs", "decode_seqs", "prefill_tokens",
        "decode_tokens", "prefill_request_ids", "decode_request_ids", "compute_ns", "ring_wait_ns",
        "ring_wait_cpu_ns",
    ),
    "cache_lookups": (
        "request_id", "instance_id", "start_ns", "end_ns", "prompt_tokens", "matched_tokens", "match",
        "matched_entry", "cache_entries", "cache_bytes", "block_size", "cache_unit",
    ),
    "prefix_blocks": ("request_id", "instance_id", "t_ns", "source", "block_index", "hash", "fingerprint"),
    "segments": (
        "request_id", "instance_id", "t_ns", "segment_index", "role", "token_start", "token_end",
        "hash", "snippet", "tail_hash",
    ),
    "cache_inserts": (
        "request_id", "instance_id", "start_ns", "end_ns", "fingerprint", "tokens", "bytes",
        "block_size", "cache_entries", "cache_bytes", "max_entries", "max_bytes", "limit_rank",
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
        "memory_free_bytes",
    ),
}

#: Packed forms of the per-token/per-block tables: the last column is a list, one element per row.
#: decode_steps: step = list index, t_ns = start_ns + offset. prefix_blocks: block_index = list
#: index, hash = element.
PACKED: dict[str, tuple[str, ...]] = {
    "decode_steps": ("request_id", "instance_id", "start_ns", "offsets"),
    "prefix_blocks": ("request_id", "instance_id", "t_ns", "source", "fingerprint", "hashes"),
}

#: Column types of every table, in ``TABLES`` order (DuckDB's names; the DDL's, checked when a store
#: opens). The parse stage builds Arrow columns of exactly these types (collector/decoding/columns.py), so
#: that what a store appends never needs a conversion it could refuse.
TYPES: dict[str, tuple[str, ...]] = {
    "spans": ("VARCHAR", "VARCHAR", "VARCHAR", "VARCHAR", "INTEGER", "BIGINT", "BIGINT", "INTEGER", "VARCHAR",
              "VARCHAR", "VARCHAR", "VARCHAR", "VARCHAR", "VARCHAR", "VARCHAR", "VARCHAR", "VARCHAR", "VARCHAR",
              "VARCHAR", "BIGINT", "BIGINT", "BIGINT"),
    "resources": ("VARCHAR",) * 6 + ("BIGINT", "VARCHAR"),
    "requests": ("VARCHAR",) * 9 + ("BIGINT", "BIGINT") + ("DOUBLE",) * 6 + ("BIGINT",) * 4
                + ("VARCHAR", "BOOLEAN", "BOOLEAN", "BIGINT", "VARCHAR", "DOUBLE", "VARCHAR", "VARCHAR"),
    "routes": ("VARCHAR",) * 5 + ("BIGINT", "BIGINT", "VARCHAR", "VARCHAR", "VARCHAR[]", "DOUBLE[]", "BIGINT",
                                  "VARCHAR[]", "DOUBLE", "BIGINT", "VARCHAR"),
    "phases": ("VARCHAR",) * 3 + ("BIGINT",) * 5 + ("VARCHAR",),
    "prefill_chunks": ("VARCHAR", "VARCHAR") + ("BIGINT",) * 5,
    "decode_steps": ("VARCHAR", "VARCHAR", "BIGINT", "BIGINT"),
    "steps": ("VARCHAR",) + ("BIGINT",) * 6 + ("VARCHAR[]", "VARCHAR[]", "BIGINT", "BIGINT", "BIGINT"),
    "cache_lookups": ("VARCHAR", "VARCHAR") + ("BIGINT",) * 4 + ("VARCHAR",) + ("BIGINT",) * 4 + ("VARCHAR",),
    "prefix_blocks": ("VARCHAR", "VARCHAR", "BIGINT", "VARCHAR", "BIGINT", "BIGINT", "BIGINT"),
    "segments": ("VARCHAR", "VARCHAR", "BIGINT", "BIGINT", "VARCHAR", "BIGINT", "BIGINT", "BIGINT", "VARCHAR",
                 "BIGINT"),
    "cache_inserts": ("VARCHAR", "VARCHAR") + ("BIGINT",) * 11,
    "cache_evictions": ("VARCHAR",) + ("BIGINT",) * 4 + ("VARCHAR",) * 3 + ("BIGINT", "BIGINT", "VARCHAR"),
    "instance_events": ("VARCHAR", "VARCHAR", "BIGINT", "VARCHAR", "VARCHAR", "VARCHAR"),
    "model_loads": ("VARCHAR",) * 4 + ("BIGINT", "BIGINT", "BOOLEAN", "VARCHAR"),
    "load_stages": ("VARCHAR",) * 6 + ("BIGINT",) * 3,
    "heartbeats": ("VARCHAR",) + ("BIGINT",) * 10 + ("VARCHAR", "BIGINT"),
}

#: Types of the packed forms' columns (``PACKED``).
PACKED_TYPES: dict[str, tuple[str, ...]] = {
    "decode_steps": ("VARCHAR", "VARCHAR", "BIGINT", "BIGINT[]"),
    "prefix_blocks": ("VARCHAR", "VARCHAR", "BIGINT", "VARCHAR", "BIGINT", "BIGINT[]"),
}
