"""Off the request path: finished exchanges become records, records become spans.

The event loop hands each finished ``Exchange`` to ``Observer.submit``. A task on the loop gets the
prompt's token ids (the upstream's ``/tokenize`` is I/O), then a worker thread measures the stream
(``measure.py``), computes the avoidable prefill, and builds the spans with explicit timestamps, on
one tracer provider per upstream (its resource names the upstream as the instance, its adapter's
engine kind, and ``tokentrace.observer = gateway``).

Spans per request (docs/gateway.md):
- upstream observed from outside: ``llm.request`` (root) with ``gateway.route``, ``llm.queue`` (when
  it waited at the gateway), ``llm.cache.lookup`` (fingerprint, segments, the engine's cached
  tokens), ``llm.decode`` (token event times) and ``llm.cache.insert`` **inferred**: the gateway
  assumes the upstream now caches the prompt it just served (no eviction is ever reported, so a
  later shortfall on the same upstream reads as capacity, inferred);
- upstream that reports itself (tokentrace engine, vLLM plugin): ``gateway.route`` only, as the
  root of the gateway's trace; the engine's ``llm.request`` is the request's row (same request id).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import queue
import socket
import threading
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from tokentrace import __version__
from tokentrace import contract as c
from tokentrace.engine_shim.emit import encode
from tokentrace.engine_shim.gateway.adapters.base import OBSERVER_GATEWAY, Adapter
from tokentrace.engine_shim.gateway.measure import Measured, gaps_ms, measure, quantile
from tokentrace.engine_shim.gateway.prompt import (
    UNIT_BYTES,
    LocalTokenizer,
    PromptPrint,
    fingerprint,
    fingerprint_local,
)
from tokentrace.engine_shim.gateway.records import Clock, Exchange
from tokentrace.fingerprint import held_hashes
from tokentrace.threads import os_named

log = logging.getLogger(__name__)

SCOPE = "tokentrace.engine_shim.gateway"
SERVICE_NAME = "tokentrace-gateway"
#: Block hashes remembered per upstream for the avoidable-prefill estimate (oldest forgotten first).
MAX_HELD_BLOCKS = 200_000
_STOP = object()


class Observer:
    """Turns finished exchanges into spans on its own thread; never raises into the gateway."""

    def __init__(self, exporter_factory, block_size: int, tokenizer: LocalTokenizer | None = None,
                 capture_content: bool = False, schedule_delay_ms: int = 200):
        self.exporter_factory = exporter_factory  #: name -> SpanExporter (one per upstream)
        self.block_size = block_size
        self.tokenizer = tokenizer
        self.capture = capture_content
        self.schedule_delay_ms = schedule_delay_ms
        self.clock = Clock()
        self.handled = 0  #: exchanges turned into spans
        self.errors = 0  #: exchanges lost to an exception (logged once)
        self._providers: dict[str, TracerProvider] = {}
        self._clusters: dict[str, str] = {}  #: upstream -> the cluster.state last sent (JSON)
        self._held: dict[str, collections.OrderedDict[int, None]] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._tasks: set[asyncio.Task] = set()
        self._thread = threading.Thread(target=os_named(self._run), name="tokentrace-observer", daemon=True)
        self._thread.start()

    # --- event loop side -------------------------------------------------------------------------
    def submit(self, exchange: Exchange, adapter: Adapter | None) -> None:
        """Hand over a finished exchange (never blocks the request path)."""
        task = asyncio.get_running_loop().create_task(self._fingerprint(exchange, adapter))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fingerprint(self, exchange: Exchange, adapter: Adapter | None) -> None:
        printed = None
        try:
            if adapter is not None and "tokenize" in adapter.measures:
                printed = await fingerprint(adapter, exchange.route, exchange.body, self.block_size, None,
                                            self.capture)
        except Exception:
            self._count_error()
        self._queue.put(("exchange", exchange, adapter, printed))

    def lifecycle(self, name: str, adapter: Adapter | None, event: str, detail: str) -> None:
        """Record a lifecycle event of an upstream (instance.down, instance.ready)."""
        self._queue.put(("lifecycle", name, adapter, event, detail, time.time_ns()))

    def cluster(self, name: str, adapter: Adapter, view: list[dict[str, Any]], findings: tuple[str, ...]) -> None:
        """Record a multi-node upstream's placement and readiness (a ``cluster.state`` span) when it
        differs from what was last sent for that upstream."""
        key = json.dumps([view, list(findings)], sort_keys=True, separators=(",", ":"))
        if self._clusters.get(name) != key:
            self._clusters[name] = key
            self._queue.put(("cluster", name, adapter, view, findings, time.time_ns()))

    async def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted exchange is exported (tests, shutdown)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
        done = threading.Event()
        self._queue.put(("flush", done))
        return await asyncio.get_running_loop().run_in_executor(None, done.wait, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Export what is left and stop."""
        self._queue.put(_STOP)
        self._thread.join(timeout)
        for provider in self._providers.values():
            provider.shutdown()

    # --- worker thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                if item[0] == "exchange":
                    self._exchange(*item[1:])
                    self.handled += 1
                elif item[0] == "lifecycle":
                    self._lifecycle(*item[1:])
                elif item[0] == "cluster":
                    self._cluster(*item[1:])
                else:
                    for provider in self._providers.values():
                        provider.force_flush(5000)
                    item[1].set()
            except Exception:
                self._count_error()

    def _count_error(self) -> None:
        self.errors += 1
        if self.errors == 1:
            log.exception("gateway telemetry error (counted; further errors are not logged)")

    def _tracer(self, name: str, adapter: Adapter | None) -> trace.Tracer:
        provider = self._providers.get(name)
        if provider is None:
            # An upstream that reports itself under its own instance id (the vLLM plugin's label)
            # gets the gateway's rows under that id, so that they meet its evictions.
            instance = (adapter.probe_result.instance_id if adapter is not None else None) or name
            attrs = {
                c.SERVICE_NAME: SERVICE_NAME, c.SERVICE_INSTANCE_ID: instance, c.HOST_NAME: socket.gethostname(),
                c.ENGINE: adapter.engine if adapter is not None else c.ENGINE_OPENAI,
                c.OBSERVER: OBSERVER_GATEWAY,
            }
            if adapter is None or not adapter.reports_itself:
                # What the gateway's own request rows measure (docs/gateway.md): its queue, TTFT and
                # decode from the stream; load and prefill only where the adapter reads them from the
                # engine. (An upstream that reports itself sends the rows; the gateway declares none.)
                parts = {"queue", "ttft", "decode", "tpot"}
                parts |= {p for p in ("load_wait", "prefill") if adapter is not None and p in adapter.measures}
                attrs[c.OBSERVER_MEASURES] = [p for p in c.OBSERVER_PARTS if p in parts]
            if adapter is not None and adapter.probe_result.version:
                attrs[c.ENGINE_VERSION] = adapter.probe_result.version
            if adapter is not None and adapter.probe_result.models:
                attrs[c.MODEL] = adapter.probe_result.models[0]
            provider = TracerProvider(resource=Resource.create(attrs))
            exporter: SpanExporter = self.exporter_factory(name)
            provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=self.schedule_delay_ms))
            self._providers[name] = provider
        return provider.get_tracer(SCOPE, __version__)

    def _lifecycle(self, name: str, adapter: Adapter | None, event: str, detail: str, t_ns: int) -> None:
        tracer = self._tracer(name, adapter)
        span = tracer.start_span(c.SPAN_LIFECYCLE, start_time=t_ns)
        span.add_event(event, timestamp=t_ns)
        if detail:
            span.set_status(trace.Status(trace.StatusCode.ERROR if event == c.EVENT_DOWN else trace.StatusCode.OK,
                                         detail if event == c.EVENT_DOWN else None))
        span.end(end_time=t_ns)

    def _cluster(self, name: str, adapter: Adapter, view: list[dict[str, Any]], findings: tuple[str, ...],
                 t_ns: int) -> None:
        attrs = {c.CLUSTER_INSTANCES: json.dumps(view, separators=(",", ":")), c.CLUSTER_FINDINGS: list(findings)}
        self._tracer(name, adapter).start_span(c.SPAN_CLUSTER_STATE, start_time=t_ns, attributes=attrs).end(t_ns)

    def _exchange(self, exchange: Exchange, adapter: Adapter | None, printed: PromptPrint | None) -> None:
        decision = exchange.decision
        name = decision.upstream.name if decision is not None else "gateway"
        if printed is None and decision is not None:
            printed = fingerprint_local(exchange.route, exchange.body, self.block_size, self.tokenizer,
                                        self.capture)
        measured = measure(exchange, adapter)
        avoidable = self._avoidable(exchange, name, printed, measured) if decision is not None else (None, None)
        tracer = self._tracer(name, adapter)
        root = self._request_span(tracer, exchange, measured, adapter)
        context = trace.set_span_in_context(root)
        self._route_span(tracer, exchange, avoidable, context)
        if adapter is not None and adapter.reports_itself and exchange.headers_ns is not None:
            # The upstream answered and sends its own row of this request (same request id): the
            # gateway's row is the outer view the store merges with it (docs/gateway.md "Upstreams
            # that report themselves"): arrival, admission wait, the client's end. The phases inside
            # are the upstream's; the gateway adds the prompt's fingerprint where the upstream sends
            # none (a vLLM plugin that cannot watch its vLLM's prompts).
            self._queue_span(tracer, context, exchange)
            if "fingerprint" not in adapter.measures and not adapter.probe_result.details.get("fingerprint"):
                self._cache_spans(tracer, context, exchange, measured, printed)
        else:
            self._children(tracer, context, exchange, measured, printed)
        root.end(end_time=self._t(exchange.end_ns or exchange.arrival_ns))

    def _t(self, perf_ns: int) -> int:
        return self.clock.epoch(perf_ns)

    def _ms(self, exchange: Exchange, perf_ns: int | None) -> float | None:
        return None if perf_ns is None else (perf_ns - exchange.arrival_ns) / 1e6

    def _request_span(self, tracer, exchange: Exchange, measured: Measured, adapter: Adapter | None):
        facts = measured.facts
        attrs: dict[str, Any] = {
            c.REQUEST_ID: exchange.request_id, c.ENDPOINT: exchange.route.path, c.STREAMED: exchange.streamed,
            c.CLIENT_DISCONNECTED: exchange.client_disconnected,
            c.GATEWAY_WAIT_MS: exchange.wait_ns / 1e6,
            # Beside an upstream that reports itself, the engine's own row holds its queue (the store
            # adds the two): the gateway's row holds only the wait at the gateway.
            c.QUEUE_MS: exchange.wait_ns / 1e6 + (
                0.0 if adapter is not None and adapter.reports_itself else facts.queue_ms or 0.0),
        }
        if exchange.session_id:
            attrs[c.SESSION_ID] = exchange.session_id
        model = exchange.body.get("model")
        if isinstance(model, str):
            attrs[c.MODEL] = model
        max_tokens = exchange.body.get("max_tokens", exchange.body.get("max_completion_tokens"))
        if isinstance(max_tokens, int):
            attrs[c.MAX_TOKENS] = max_tokens
        if exchange.status is not None:
            attrs[c.HTTP_STATUS] = exchange.status
        error = exchange.error_type or (f"upstream_error: {facts.error}" if facts.error else None)
        if error:
            attrs[c.ERROR_TYPE] = error
        for key, value in ((c.INPUT_TOKENS, facts.prompt_tokens), (c.OUTPUT_TOKENS, facts.completion_tokens),
                           (c.CACHED_TOKENS, facts.cached_tokens), (c.LOAD_WAIT_MS, facts.load_ms),
                           (c.PREFILL_MS, facts.prefill_ms)):
            if value is not None:
                attrs[key] = value
        reasons = list(facts.finish_reasons)
        if exchange.client_disconnected and not reasons:
            reasons = ["cancelled"]
        if reasons:
            attrs[c.FINISH_REASONS] = reasons
        ttft = self._ms(exchange, measured.first_token_ns)
        if ttft is not None:
            attrs[c.TTFT_MS] = ttft
        first_content = self._ms(exchange, measured.first_content_ns)
        if first_content is not None:
            attrs[c.FIRST_CONTENT_MS] = first_content
        if exchange.end_ns is not None:
            attrs[c.E2E_MS] = (exchange.end_ns - exchange.arrival_ns) / 1e6
        if len(measured.token_ns) >= 2 or (measured.token_ns and facts.completion_tokens == 1):
            # Decode is seen in the token events' times: two or more, or the one of a one-token answer.
            # One event of a longer answer, or of an unknown count (a detokenizer held byte tokens back
            # and sent them together), shows no decode: unknown, never 0.
            decode = (measured.token_ns[-1] - measured.token_ns[0]) / 1e6
            attrs[c.DECODE_MS] = decode
            outputs = facts.completion_tokens or len(measured.token_ns)
            if outputs > 1:
                attrs[c.TPOT_MS] = decode / (outputs - 1)
        elif facts.decode_ms is not None:
            # A non-streamed answer has no token times at the gateway; the engine's own decode time
            # (Ollama eval_duration, llama.cpp predicted_ms) is the phase.
            attrs[c.DECODE_MS] = facts.decode_ms
            if facts.completion_tokens and facts.completion_tokens > 1:
                attrs[c.TPOT_MS] = facts.decode_ms / (facts.completion_tokens - 1)
        evidence = dict(facts.evidence)
        if measured.response_id and measured.response_id != exchange.request_id:
            # The upstream's own id of this answer (llama.cpp's chatcmpl-..., vLLM's, mlx_lm.server's):
            # an alias every lookup of the request accepts (request_alias.sql).
            evidence[c.UPSTREAM_RESPONSE_ID] = measured.response_id
        if evidence:
            attrs[c.UPSTREAM_EVIDENCE] = json.dumps(evidence, separators=(",", ":"), sort_keys=True)
        return tracer.start_span(c.SPAN_REQUEST, kind=trace.SpanKind.SERVER, attributes=attrs,
                                 start_time=self._t(exchange.arrival_ns))

    def _route_span(self, tracer, exchange: Exchange, avoidable: tuple[int | None, str | None], context):
        decision = exchange.decision
        attrs: dict[str, Any] = {
            c.REQUEST_ID: exchange.request_id, c.ROUTE_POLICY: exchange.policy,
            c.ROUTE_ATTEMPTS: exchange.attempts, c.GATEWAY_WAIT_MS: exchange.wait_ns / 1e6,
        }
        if exchange.session_id:
            attrs[c.SESSION_ID] = exchange.session_id
        if decision is not None:
            attrs.update({c.ROUTE_CANDIDATES: list(decision.candidates), c.ROUTE_SCORES: list(decision.scores),
                          c.ROUTE_CHOICE: decision.upstream.name, c.ROUTE_REASON: decision.reason})
        if exchange.skipped:
            attrs[c.ROUTE_SKIPPED] = list(exchange.skipped)
        tokens, source = avoidable
        if tokens is not None:
            attrs[c.AVOIDABLE_PREFILL] = tokens
        if source:
            attrs[c.AVOIDABLE_FROM] = source
        kind = trace.SpanKind.SERVER if context is None else trace.SpanKind.INTERNAL
        span = tracer.start_span(c.SPAN_ROUTE, context=context, kind=kind, attributes=attrs,
                                 start_time=self._t(exchange.arrival_ns))
        span.end(end_time=self._t(exchange.sent_ns or exchange.end_ns or exchange.arrival_ns))
        return span

    def _queue_span(self, tracer, context, exchange: Exchange) -> None:
        """The wait for a slot at the gateway (``llm.queue``): its depth, and the requests in flight on
        the upstream (the slowness verdict's blockers)."""
        if exchange.wait_ns and exchange.admitted_ns is not None:
            self._span(tracer, context, c.SPAN_QUEUE, exchange.admitted_ns - exchange.wait_ns, exchange.admitted_ns,
                       {c.REQUEST_ID: exchange.request_id, c.QUEUE_DEPTH: exchange.queue_depth,
                        c.QUEUE_RUNNING: exchange.queue_running, c.MAX_BATCH: exchange.decision.upstream.limit})

    def _children(self, tracer, context, exchange: Exchange, measured: Measured, printed: PromptPrint | None) -> None:
        rid = exchange.request_id
        self._queue_span(tracer, context, exchange)
        self._cache_spans(tracer, context, exchange, measured, printed)
        if measured.token_ns:
            offsets = [t - measured.token_ns[0] for t in measured.token_ns]
            itl = gaps_ms(measured.token_ns)
            attrs = {c.REQUEST_ID: rid, c.DECODE_STEPS: len(offsets), c.DECODE_STEP_OFFSETS: offsets}
            for key, q in ((c.ITL_P50_MS, 0.5), (c.ITL_P90_MS, 0.9)):
                value = quantile(itl, q)
                if value is not None:
                    attrs[key] = value
            if itl:
                attrs[c.ITL_MAX_MS] = max(itl)
            self._span(tracer, context, c.SPAN_DECODE, measured.token_ns[0], measured.token_ns[-1], attrs)

    def _cache_spans(self, tracer, context, exchange: Exchange, measured: Measured,
                     printed: PromptPrint | None) -> None:
        """The lookup (fingerprint, segments, the engine's cached tokens) and, after a success, the
        insert the gateway infers: the upstream now holds the prompt it served."""
        if printed is None or not printed.hashes:
            return
        rid, facts = exchange.request_id, measured.facts
        sent = exchange.sent_ns or exchange.arrival_ns
        # An engine that caches whole blocks can reuse only the prompt's complete blocks: the
        # lookup's fingerprint covers those, so that a repeat reusing all of them is a hit.
        held = self._held_blocks(exchange, printed)
        attrs = self._lookup_attrs(rid, printed, facts.prompt_tokens, facts.cached_tokens)
        if held:
            attrs[c.CACHE_BLOCK_HASHES] = held
        self._span(tracer, context, c.SPAN_CACHE_LOOKUP, exchange.arrival_ns, sent, attrs)
        if held and exchange.status == 200 and not exchange.error_type:
            end = exchange.end_ns or sent
            self._span(tracer, context, c.SPAN_CACHE_INSERT, end, end, encode.prompt_insert(
                request_id=rid, prompt_length=printed.length, block_size=printed.block_size, held=held))

    @staticmethod
    def _held_blocks(exchange: Exchange, printed: PromptPrint) -> list[int]:
        """The prompt's block hashes the upstream can hold: an engine that caches whole blocks of
        B tokens (vLLM) keeps only the prompt's complete B-token blocks."""
        adapter = exchange.decision.upstream.adapter if exchange.decision else None
        granularity = adapter.probe_result.cache_block_tokens if adapter is not None else 1
        if printed.unit != "tokens":
            return printed.hashes
        return held_hashes(printed.hashes, printed.length, granularity, printed.block_size)

    def _lookup_attrs(self, rid: str, printed: PromptPrint, prompt_tokens: int | None,
                      cached: int | None) -> dict[str, Any]:
        return encode.prompt_lookup(
            request_id=rid, prompt_length=printed.length, block_size=printed.block_size, hashes=printed.hashes,
            matched=self._in_units(printed, prompt_tokens, cached),
            segments=[(s.role, s.start, s.end, s.hash, s.tail) for s in printed.segments],
            snippets=[s.snippet or "" for s in printed.segments] if self.capture else None)

    @staticmethod
    def _in_units(printed: PromptPrint, prompt_tokens: int | None, cached: int | None) -> int | None:
        """The engine's cached tokens in the fingerprint's unit (bytes: the same share of the bytes)."""
        if cached is None:
            return None
        if printed.unit != UNIT_BYTES:
            return min(cached, printed.length)
        if not prompt_tokens:
            return None
        return round(printed.length * min(cached, prompt_tokens) / prompt_tokens)

    def _span(self, tracer, context, name: str, start_perf: int, end_perf: int, attrs: dict[str, Any]) -> None:
        span = tracer.start_span(name, context=context, attributes=attrs, start_time=self._t(start_perf))
        span.end(end_time=self._t(max(end_perf, start_perf)))

    def _avoidable(self, exchange: Exchange, chosen: str, printed: PromptPrint | None,
                   measured: Measured) -> tuple[int | None, str | None]:
        """Prompt tokens another upstream held (by the gateway's record of what each served) beyond
        what the chosen one reused; then record that the chosen one now holds this prompt."""
        if printed is None or not printed.hashes:
            return None, None
        block = printed.block_size
        depth = {name: self._depth(held, printed.hashes) for name, held in self._held.items()}
        facts = measured.facts
        reused = self._in_units(printed, facts.prompt_tokens, facts.cached_tokens)
        if reused is None:
            reused = min(printed.length, depth.get(chosen, 0) * block)
        best, source = 0, None
        for name, blocks in depth.items():
            covered = min(printed.length, blocks * block)
            if name != chosen and covered - reused >= block and covered > best:
                best, source = covered, name
        avoidable = best - reused if source else 0
        if printed.unit == UNIT_BYTES and avoidable:
            avoidable = round(avoidable * facts.prompt_tokens / printed.length) if facts.prompt_tokens else None
        if exchange.status == 200 and not exchange.error_type:
            held = self._held.setdefault(chosen, collections.OrderedDict())
            for value in self._held_blocks(exchange, printed):
                held[value] = None
                held.move_to_end(value)
            while len(held) > MAX_HELD_BLOCKS:
                held.popitem(last=False)
        return avoidable, source

    @staticmethod
    def _depth(held: collections.OrderedDict[int, None], hashes: list[int]) -> int:
        depth = 0
        for value in hashes:
            if value not in held:
                break
            depth += 1
        return depth
