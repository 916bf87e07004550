"""Pure conversions from vLLM's stat objects to contract spans (no vLLM import).

Inputs are the objects vLLM 0.30–0.32 hands a stat logger (``vllm/v1/metrics/stats.py``):
``FinishedRequestStats`` per finished request, ``SchedulerIterationDetails`` per engine step (only
with ``--enable-logging-iteration-details``) and ``SchedulerStats``. Clocks: vLLM's phase durations
are differences of EngineCore monotonic timestamps, and ``IterationStats.iteration_timestamp`` is
the API server's wall clock when it processed the step's outputs; spans are anchored there.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from tokentrace import contract as c
from tokentrace.engine_shim.emit import encode
from tokentrace.engine_shim.vllm.export import SpanEvent, SpanRecord, new_span_id, new_trace_id
from tokentrace.fingerprint import held_hashes

#: vLLM FinishReason strings (vllm/v1/engine/__init__.py::FINISH_REASON_STRINGS) -> contract values.
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled", "error": "error",
                  "repetition": "stop"}

#: engine.steps windows close after this many steps or this much time (DESIGN §3: N steps or <= 1 s).
WINDOW_STEPS = 256
WINDOW_NS = 1_000_000_000


def preemption_evidence(preemptions: int, reuse: Any = None) -> dict[str, Any]:
    """``tokentrace.upstream.evidence`` facts for a request vLLM preempted (empty if it was not).

    ``cached_tokens`` (vLLM's ``num_cached_tokens``) counts only the prefix hits of the request's
    first admission; what it got back from the prefix cache when it resumed after a preemption —
    largely its own blocks — is recomputed work vLLM skipped, which vLLM's ``PrefixCacheStats``
    counts as ``preempted_hits``. ``reuse`` (a ``kv_events.RequestReuse``, full KV-event reports
    only) says how many tokens that was.
    """
    if preemptions <= 0:
        return {}
    facts: dict[str, Any] = {"vllm.preemptions": preemptions}
    times = "once" if preemptions == 1 else f"{preemptions} times"
    reason = f"vLLM preempted it {times} and recomputed it on resuming"
    if reuse is not None and reuse.resumes:
        facts["vllm.preempted_hit_tokens"] = reuse.recomputed_tokens
        facts["vllm.preempted_own_tokens"] = reuse.own_tokens
        reason += (f"; {reuse.recomputed_tokens} of those tokens came back from the prefix cache "
                   f"({reuse.own_tokens} from blocks it had stored itself)")
    facts["vllm.reprocess_reason"] = reason + (
        ": not prefix hits, so not in its cached tokens (vLLM's own counter counts them as preempted hits)")
    return facts


#: Clock readings are taken apart (wall and monotonic, two processes): an intake this far below 0
#: or past the time the engine's phases leave is still the same host's clocks, read a moment apart.
INTAKE_SLACK_S = 0.005


def engine_intake_s(finished: Any, times: Any, ts: float, wall_minus_monotonic: float) -> float | None:
    """Seconds from the API server's arrival of a finished request to vLLM's engine core taking it in
    (its ``QUEUED`` event), or None where that cannot be told.

    ``times`` is the request's ``RequestStateStats`` as the output processor kept it: ``arrival_time``
    on the API server's wall clock, ``queued_ts`` on the engine core's monotonic clock.
    ``wall_minus_monotonic`` (this process's ``time.time() - time.monotonic()``) carries one to the
    other; that holds only where the engine core runs on this host (one system-wide monotonic
    clock). An engine core elsewhere (data parallel across hosts) gives an intake outside
    [0, e2e - the engine's phases], which is None: never a number from two unrelated clocks. The
    intake is the API server's rendering and tokenizing, the hand-over, and the wait in the engine
    core's input queue while it runs a step: time the request waited before vLLM could queue it.
    """
    queued_ts = float(getattr(times, "queued_ts", 0.0) or 0.0)
    arrival = float(getattr(times, "arrival_time", 0.0) or 0.0)
    if queued_ts <= 0.0 or arrival <= 0.0:
        return None
    intake = queued_ts + wall_minus_monotonic - arrival
    engine = sum(max(float(x), 0.0) for x in (finished.queued_time, finished.prefill_time, finished.decode_time))
    room = ts - arrival - engine
    if not -INTAKE_SLACK_S <= intake <= room + INTAKE_SLACK_S:
        return None
    return min(max(intake, 0.0), max(room, 0.0))


def intake_evidence(intake: float, queued: float) -> dict[str, Any]:
    """``tokentrace.upstream.evidence`` facts for a request's queue, split at the engine core's intake."""
    facts: dict[str, Any] = {"vllm.intake_ms": round(intake * 1e3, 3), "vllm.engine_queue_ms": round(queued * 1e3, 3)}
    if intake >= 0.001:
        facts["vllm.queue_reason"] = (
            f"{intake * 1e3:,.1f} ms of its queue passed before vLLM's engine core took it in (vLLM's API "
            f"server rendering and tokenizing it and handing it over, or the engine core busy with a step), "
            f"{queued * 1e3:,.1f} ms in the engine core's own queue")
    return facts


def request_record(
    ts: float, finished: Any, request_id: Callable[[str], str], model: str, first: bool,
    reuse: Any = None, intake: float | None = None,
) -> SpanRecord:
    """The ``llm.request`` span for one ``FinishedRequestStats`` seen at wall time ``ts`` (s).

    The span ends at ``ts`` and starts ``e2e_latency`` earlier (vLLM's arrival time). TTFT is
    e2e minus decode: vLLM passes no per-request first-token time to stat loggers, and the
    engine-to-frontend delay is the same for the first and the last token. The queue is vLLM's
    ``queued_time`` (its engine core's queue) plus ``intake`` (``engine_intake_s``) where it is
    known: from arrival to admission, as every engine's queue. A preempted request carries its
    preemptions as evidence (``preemption_evidence``; ``reuse`` from the KV events).
    """
    end_ns = int(ts * 1e9)
    e2e = max(float(finished.e2e_latency), 0.0)
    decode = max(float(finished.decode_time), 0.0)
    queued = max(float(finished.queued_time), 0.0)
    output_tokens = int(finished.num_generation_tokens)
    reason = str(finished.finish_reason)
    attrs: dict[str, Any] = {
        c.REQUEST_ID: request_id(str(finished.request_id)),
        c.INPUT_TOKENS: int(finished.num_prompt_tokens),
        c.OUTPUT_TOKENS: output_tokens,
        c.CACHED_TOKENS: int(finished.num_cached_tokens),
        c.FINISH_REASONS: [FINISH_REASONS.get(reason, reason)],
        c.PROVIDER_NAME: c.ENGINE_VLLM,
        # vLLM's server starts listening only after the model is loaded and warmed up.
        c.LOAD_WAIT_MS: 0.0,
        c.QUEUE_MS: ((intake or 0.0) + queued) * 1e3,
        c.PREFILL_MS: max(float(finished.prefill_time), 0.0) * 1e3,
        c.DECODE_MS: decode * 1e3,
        c.TTFT_MS: max(e2e - decode, 0.0) * 1e3,
    }
    if model:
        attrs[c.MODEL] = model
    if finished.max_tokens_param is not None:
        attrs[c.MAX_TOKENS] = int(finished.max_tokens_param)
    if output_tokens > 1:
        attrs[c.TPOT_MS] = decode * 1e3 / (output_tokens - 1)
    evidence = preemption_evidence(int(getattr(finished, "num_preemptions", 0) or 0), reuse)
    if intake is not None:
        evidence.update(intake_evidence(intake, queued))
    if evidence:
        attrs[c.UPSTREAM_EVIDENCE] = json.dumps(evidence, separators=(",", ":"), sort_keys=True)
    events = [SpanEvent(c.EVENT_FIRST_RESPONSE, end_ns)] if first else []
    return SpanRecord(c.SPAN_REQUEST, end_ns - int(e2e * 1e9), end_ns, attrs, events, server=True,
                      trace_id=new_trace_id(), span_id=new_span_id())


def cache_records(root: SpanRecord, finished: Any, printed: Any, engine_block: int | None) -> list[SpanRecord]:
    """The ``llm.cache.lookup`` of a finished request whose prompt the plugin saw (``printed``, a
    ``prompts.Printed``), at its admission (arrival + queue), and the ``llm.cache.insert`` vLLM's
    prefix cache then holds: the prompt's complete ``engine_block``-token blocks, as the gateway
    infers it in front of a vLLM (children of the request span ``root``)."""
    if printed is None or not printed.hashes:
        return []
    rid, block = root.attributes[c.REQUEST_ID], printed.block_size
    admitted = min(root.start_ns + int(root.attributes[c.QUEUE_MS] * 1e6), root.end_ns)
    ids = {"trace_id": root.trace_id, "parent_span_id": root.span_id}
    matched = min(int(finished.num_cached_tokens), printed.length)
    # vLLM caches whole blocks: the lookup's fingerprint covers the prompt's complete ones, so that a
    # repeat reusing all of them is a hit (the gateway's rule, engine_shim/gateway/observe.py).
    held = held_hashes(printed.hashes, printed.length, engine_block, block)
    records = [SpanRecord(c.SPAN_CACHE_LOOKUP, admitted, admitted, encode.prompt_lookup(
        request_id=rid, prompt_length=printed.length, block_size=block, hashes=held or printed.hashes,
        matched=matched, segments=printed.segments), **ids)]
    if held:
        records.append(SpanRecord(c.SPAN_CACHE_INSERT, root.end_ns, root.end_ns, encode.prompt_insert(
            request_id=rid, prompt_length=printed.length, block_size=block, held=held), **ids))
    return records


def abort_record(abort: Any, request_id: Callable[[str], str], model: str) -> SpanRecord:
    """The ``llm.request`` of a request vLLM aborted before its engine finished it (a
    ``prompts.Abort``): vLLM's finish reason ``abort`` (``cancelled``), the tokens it had generated,
    no phases (vLLM's stat loggers never see it)."""
    attrs: dict[str, Any] = {c.REQUEST_ID: request_id(abort.external_id), c.FINISH_REASONS: [FINISH_REASONS["abort"]],
                             c.OUTPUT_TOKENS: abort.output_tokens, c.PROVIDER_NAME: c.ENGINE_VLLM}
    if abort.prompt_tokens is not None:
        attrs[c.INPUT_TOKENS] = abort.prompt_tokens
    if model:
        attrs[c.MODEL] = model
    if abort.max_tokens is not None:
        attrs[c.MAX_TOKENS] = int(abort.max_tokens)
    return SpanRecord(c.SPAN_REQUEST, abort.start_ns, max(abort.end_ns, abort.start_ns), attrs, server=True)


def refusal_record(refusal: Any, model: str) -> SpanRecord:
    """The ``llm.request`` of a request vLLM's frontend answered with an error before its engine saw
    it (a ``prompts.Refusal``): its id, status and error, no phases (none ran)."""
    attrs: dict[str, Any] = {c.REQUEST_ID: refusal.request_id, c.HTTP_STATUS: refusal.status,
                             c.ERROR_TYPE: refusal.error_type, c.PROVIDER_NAME: c.ENGINE_VLLM}
    if refusal.model or model:
        attrs[c.MODEL] = refusal.model or model
    if refusal.max_tokens is not None:
        attrs[c.MAX_TOKENS] = int(refusal.max_tokens)
    return SpanRecord(c.SPAN_REQUEST, refusal.start_ns, max(refusal.end_ns, refusal.start_ns), attrs, server=True)


class StepWindow:
    """Collects per-step numbers and emits one ``engine.steps`` span per window.

    ``add`` runs on vLLM's output loop and ``flush`` on the export thread; a lock held for a list
    append or swap keeps them apart.
    """

    def __init__(self) -> None:
        self._steps: list[tuple[int, int, int, int, int, int]] = []
        self._lock = threading.Lock()

    def add(self, ts: float, details: Any) -> None:
        """One step that ended at wall time ``ts`` (s); ``details`` is SchedulerIterationDetails."""
        duration = int(float(details.elapsed_ms) * 1e6)
        step = (
            int(ts * 1e9) - duration, duration, int(details.num_ctx_requests),
            int(details.num_generation_requests), int(details.num_ctx_tokens),
            int(details.num_generation_tokens),
        )
        with self._lock:
            self._steps.append(step)

    def flush(self, now_ns: int, force: bool = False) -> list[SpanRecord]:
        """Windows that are complete at ``now_ns`` (all of them when ``force``)."""
        with self._lock:
            steps = self._steps
            if not steps:
                return []
            if not force and len(steps) < WINDOW_STEPS and now_ns - steps[0][0] < WINDOW_NS:
                return []
            self._steps = []
        steps.sort()
        return [steps_record(steps[i : i + WINDOW_STEPS]) for i in range(0, len(steps), WINDOW_STEPS)]


def steps_record(steps: list[tuple[int, int, int, int, int, int]]) -> SpanRecord:
    """One ``engine.steps`` span over (start ns, duration ns, prefill seqs, decode seqs,
    prefill tokens, decode tokens) tuples sorted by start. vLLM names no requests per step, so
    ``tokentrace.steps.requests`` and ``.members`` are left out."""
    start, end, attrs = encode.steps_window(*zip(*steps, strict=True))
    return SpanRecord(c.SPAN_ENGINE_STEPS, start, end, attrs)


def heartbeat_record(
    now_ns: int,
    stats: Any,
    vllm_config: Any,
    bytes_per_token: int | None,
    cached_blocks: int | None,
    report_mode: str | None = None,
    preempted_hit_tokens: int | None = None,
) -> SpanRecord:
    """``instance.heartbeat`` from the latest ``SchedulerStats``; cache entries are vLLM blocks.

    ``cached_blocks`` comes from the KV-event stream (None without it), ``report_mode`` says what
    that stream reports (``full`` or ``incremental``), ``preempted_hit_tokens`` is vLLM's own
    ``PrefixCacheStats.preempted_hits`` summed since start. Memory is the KV cache in use by running
    requests (``kv_cache_usage`` x pool), the only memory figure a stat logger sees.
    """
    scheduler = getattr(vllm_config, "scheduler_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    max_seqs = getattr(scheduler, "max_num_seqs", None)
    blocks = int(getattr(cache, "num_gpu_blocks", None) or 0) or None
    block_size = getattr(cache, "block_size", None)
    block_bytes = bytes_per_token * block_size if bytes_per_token and block_size else None
    attrs = encode.heartbeat(
        unit=c.UNIT_BLOCK,
        queue_depth=int(stats.num_waiting_reqs) + int(getattr(stats, "num_skipped_waiting_reqs", 0)),
        running=int(stats.num_running_reqs),
        max_batch=int(max_seqs) if max_seqs else None,
        cache_entries=cached_blocks,
        cache_bytes=cached_blocks * block_bytes if cached_blocks is not None and block_bytes else None,
        cache_max_entries=blocks,
        cache_max_bytes=blocks * block_bytes if blocks and block_bytes else None,
        kv_bytes_per_token=bytes_per_token or None,
        memory_bytes=int(float(stats.kv_cache_usage) * blocks * block_bytes) if blocks and block_bytes else None,
    )
    if report_mode is not None:
        attrs[c.CACHE_REPORT_MODE] = report_mode
    if preempted_hit_tokens is not None:
        attrs[c.CACHE_PREEMPTED_HIT_TOKENS] = preempted_hit_tokens
    return SpanRecord(c.SPAN_HEARTBEAT, now_ns, now_ns, attrs)
