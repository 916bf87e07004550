"""Synthetic OTLP traces shaped like the engine shim's: for benchmarks only (never for tests).

One request is 9 spans (llm.request, llm.queue, llm.cache.lookup with block hashes and segments,
llm.prefill with 2 chunks, llm.decode with per-token offsets, llm.cache.insert), plus one
engine.steps window per 16 requests. Prompts share prefixes within a session, so cache analyzers
have realistic matches to find.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace import contract as c
from tokentrace.fingerprint import block_hashes, segment_hash

BLOCK = c.DEFAULT_BLOCK_SIZE


def _set(span, key: str, value) -> None:
    attr = span.attributes.add(key=key)
    if isinstance(value, bool):
        attr.value.bool_value = value
    elif isinstance(value, int):
        attr.value.int_value = value
    elif isinstance(value, float):
        attr.value.double_value = value
    elif isinstance(value, str):
        attr.value.string_value = value
    elif value and isinstance(value[0], str):
        attr.value.array_value.values.extend(_any_str(v) for v in value)
    else:
        attr.value.array_value.values.extend(_any_int(v) for v in value)


def _any_str(value: str):
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

    return AnyValue(string_value=value)


def _any_int(value: int):
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

    return AnyValue(int_value=value)


def salt_of(replica: int) -> int:
    """The signed 64-bit value a replica's hashes are XORed with (0 for replica 0): replicas of one
    seed share no prefix, as different seeds' workloads do not."""
    return 0 if not replica else random.Random(f"salt-{replica}").getrandbits(64) - (1 << 63)


#: Tokens of a session's history that later prompts repeat (bench/synth.Workload).
HISTORY = 2048


class Workload:
    """Deterministic stream of engine-shaped requests over ``instances`` instances.

    With ``replica`` given, trace and span ids come from the seed too (their first two bytes are the
    replica number) and every prompt hash is XORed with ``salt_of(replica)``: replica r of a seed is
    replica 0's workload with other ids and unrelated prefixes, which bench/analyze.py can write by
    copying replica 0's stored rows (and checks it equals ingesting it). Without it, ids are random.

    A session's history grows by every turn up to ``HISTORY`` tokens, so prompts lengthen over the
    first ~12 turns of each session (~6,000 requests of one workload). ``full_histories`` starts every
    session with a full history of its own: prompts are as long from the first request as they will
    ever be, for a benchmark that needs a stationary workload (bench/soak.py)."""

    def __init__(self, seed: int = 7, instances: int = 4, sessions: int = 500, start_ns: int | None = None,
                 replica: int | None = None, full_histories: bool = False):
        self.rng = random.Random(seed)
        self._ids = None if replica is None else random.Random(f"ids-{seed}")
        self._prefix = (replica or 0).to_bytes(2, "big")
        self.salt = salt_of(replica or 0)
        self.instances = [f"bench-{i}" for i in range(instances)]
        self.systems = [[self.rng.randrange(1, 30000) for _ in range(self.rng.choice((64, 256, 512)))]
                        for _ in range(8)]
        full = HISTORY if full_histories else 0
        self.sessions = [(self.rng.randrange(8), [self.rng.randrange(1, 30000) for _ in range(full)])
                         for _ in range(sessions)]
        self.clock = start_ns if start_ns is not None else 1_700_000_000_000_000_000
        self.count = 0

    def _id(self, size: int) -> bytes:
        return os.urandom(size) if self._ids is None else self._prefix + self._ids.randbytes(size - 2)

    def _hashes(self, tokens: list[int]) -> list[int]:
        return [h ^ self.salt for h in block_hashes(tokens)]

    def _segment(self, tokens: list[int]) -> int:
        return segment_hash(tokens) ^ self.salt

    def _span(self, spans, trace_id: bytes, parent: bytes, name: str, start: int, end: int, rid: str, kind: int = 1):
        span = spans.add(trace_id=trace_id, span_id=self._id(8), parent_span_id=parent, name=name, kind=kind,
                         start_time_unix_nano=start, end_time_unix_nano=end)
        _set(span, c.REQUEST_ID, rid)
        return span

    def request(self, spans) -> int:
        """Append one request's spans (plus an engine.steps window every 16th); returns spans added."""
        rng, self.count = self.rng, self.count + 1
        rid, trace_id = f"req-{self.count:08d}", self._id(16)
        system, history = self.sessions[rng.randrange(len(self.sessions))]
        turn = [rng.randrange(1, 30000) for _ in range(rng.randrange(16, 200))]
        prompt = self.systems[system] + history + turn
        cached = len(self.systems[system]) + len(history) if history and rng.random() < 0.7 else 0
        output = rng.randrange(8, 128)
        history.extend(turn + [rng.randrange(1, 30000) for _ in range(output)])
        del history[:-HISTORY]
        self.clock += rng.randrange(2_000_000, 40_000_000)
        t0, queue = self.clock, rng.randrange(0, 30_000_000)
        prefill = (len(prompt) - cached) * 40_000 + 2_000_000
        itl = rng.randrange(8_000_000, 25_000_000)
        t_prefill, t_decode = t0 + queue, t0 + queue + prefill
        t_end = t_decode + itl * (output - 1)
        root = self._span(spans, trace_id, b"", c.SPAN_REQUEST, t0, t_end + 500_000, rid, kind=2)
        for key, value in ((c.SESSION_ID, f"s{system}"), (c.ENDPOINT, "/v1/chat/completions"),
                           (c.MODEL, "bench-model"), (c.MAX_TOKENS, 256), (c.STREAMED, True),
                           (c.CLIENT_DISCONNECTED, False), (c.HTTP_STATUS, 200),
                           (c.INPUT_TOKENS, len(prompt)), (c.OUTPUT_TOKENS, output), (c.CACHED_TOKENS, cached),
                           (c.FINISH_REASONS, ["length"]), (c.QUEUE_MS, queue / 1e6), (c.LOAD_WAIT_MS, 0.0),
                           (c.PREFILL_MS, prefill / 1e6), (c.DECODE_MS, (t_end - t_decode) / 1e6),
                           (c.TTFT_MS, (t_decode - t0) / 1e6), (c.TPOT_MS, itl / 1e6)):
            _set(root, key, value)
        parent = root.span_id
        q = self._span(spans, trace_id, parent, c.SPAN_QUEUE, t0, t_prefill, rid)
        _set(q, c.QUEUE_DEPTH, rng.randrange(0, 4))
        _set(q, c.QUEUE_RUNNING, rng.randrange(0, 8))
        lookup = self._span(spans, trace_id, parent, c.SPAN_CACHE_LOOKUP, t_prefill, t_prefill + 200_000, rid)
        for key, value in ((c.CACHE_PROMPT_TOKENS, len(prompt)), (c.CACHE_MATCHED_TOKENS, cached),
                           (c.CACHE_MATCH, c.MATCH_PREFIX if cached else c.MATCH_NONE), (c.CACHE_ENTRIES, 10),
                           (c.CACHE_BYTES, 50_000_000), (c.CACHE_BLOCK_SIZE, BLOCK),
                           (c.CACHE_BLOCK_HASHES, self._hashes(prompt)),
                           (c.SEGMENT_ROLES, ["system", "user"]),
                           (c.SEGMENT_STARTS, [0, len(self.systems[system])]),
                           (c.SEGMENT_ENDS, [len(self.systems[system]), len(prompt)]),
                           (c.SEGMENT_HASHES, [self._segment(self.systems[system]), self._segment(turn)])):
            _set(lookup, key, value)
        pre = self._span(spans, trace_id, parent, c.SPAN_PREFILL, t_prefill, t_decode, rid)
        half = t_prefill + prefill // 2
        for offset, (a, b) in enumerate(((t_prefill, half), (half, t_decode))):
            chunk = self._span(spans, trace_id, pre.span_id, c.SPAN_PREFILL_CHUNK, a, b, rid)
            _set(chunk, c.CHUNK_OFFSET, cached + offset * (len(prompt) - cached) // 2)
            _set(chunk, c.CHUNK_TOKENS, (len(prompt) - cached) // 2)
        dec = self._span(spans, trace_id, parent, c.SPAN_DECODE, t_decode, t_end, rid)
        _set(dec, c.DECODE_STEPS, output)
        _set(dec, c.DECODE_STEP_OFFSETS, [i * itl for i in range(output)])
        ins = self._span(spans, trace_id, parent, c.SPAN_CACHE_INSERT, t_end, t_end + 300_000, rid)
        stored = prompt + [1] * output
        hashes = self._hashes(stored)
        for key, value in ((c.ENTRY_FINGERPRINT, hashes[-1]), (c.ENTRY_TOKENS, len(stored)),
                           (c.ENTRY_BYTES, len(stored) * 4096), (c.CACHE_BLOCK_SIZE, BLOCK),
                           (c.CACHE_BLOCK_HASHES, hashes)):
            _set(ins, key, value)
        added = 9
        if self.count % 16 == 0:
            added += self._steps(spans, t0, rid)
        return added

    def _steps(self, spans, t0: int, rid: str) -> int:
        n = 64
        window = spans.add(trace_id=self._id(16), span_id=self._id(8), name=c.SPAN_ENGINE_STEPS,
                           start_time_unix_nano=t0, end_time_unix_nano=t0 + n * 10_000_000)
        for key, value in ((c.STEPS_COUNT, n), (c.STEPS_START_OFFSETS, [i * 10_000_000 for i in range(n)]),
                           (c.STEPS_DURATIONS, [9_000_000] * n), (c.STEPS_PREFILL_SEQS, [0] * n),
                           (c.STEPS_DECODE_SEQS, [1] * n), (c.STEPS_PREFILL_TOKENS, [0] * n),
                           (c.STEPS_DECODE_TOKENS, [1] * n), (c.STEPS_REQUESTS, [rid]), (c.STEPS_MEMBERS, [0] * n)):
            _set(window, key, value)
        return 1

    def batches(self, spans_per_batch: int) -> Iterator[ExportTraceServiceRequest]:
        """Endless requests of about ``spans_per_batch`` spans, one instance per request."""
        while True:
            request = ExportTraceServiceRequest()
            resource = request.resource_spans.add()
            instance = self.instances[self.count % len(self.instances)]
            for key, value in ((c.SERVICE_INSTANCE_ID, instance), (c.SERVICE_NAME, "tokentrace-engine"),
                               (c.ENGINE, c.ENGINE_MLX)):
                resource.resource.attributes.add(key=key).value.string_value = value
            spans = resource.scope_spans.add().spans
            total = 0
            while total < spans_per_batch:
                total += self.request(spans)
            yield request


def light_batches(spans_per_batch: int, seed: int = 5) -> Iterator[ExportTraceServiceRequest]:
    """Endless batches of small generic spans (8 scalar attributes, no arrays): what an ordinary
    OTLP sender exports, for comparing ingest cost per span against the engine's heavy spans."""
    rng, clock = random.Random(seed), 1_700_000_000_000_000_000
    while True:
        request = ExportTraceServiceRequest()
        resource = request.resource_spans.add()
        resource.resource.attributes.add(key=c.SERVICE_NAME).value.string_value = "checkout"
        spans = resource.scope_spans.add().spans
        for _ in range(spans_per_batch):
            clock += rng.randrange(100_000, 2_000_000)
            span = spans.add(trace_id=os.urandom(16), span_id=os.urandom(8), name="GET /cart", kind=2,
                             start_time_unix_nano=clock, end_time_unix_nano=clock + 3_000_000)
            for key, value in (("http.request.method", "GET"), ("http.route", "/cart"),
                               ("http.response.status_code", 200), ("server.address", "shop.local"),
                               ("user_agent.original", "curl/8.5"), ("net.peer.port", 51234),
                               ("retry", False), ("ratio", 0.25)):
                _set(span, key, value)
        yield request

