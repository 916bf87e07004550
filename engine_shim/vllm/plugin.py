"""tokentrace's vLLM stat logger: request rows, engine steps, heartbeats, evictions, cold start.

Registered under the entry-point group ``vllm.stat_logger_plugins`` (pyproject), which only
``AsyncLLM`` loads (``vllm serve``; ``vllm/v1/engine/async_llm.py``), in the API-server process. vLLM
makes one per engine and calls ``record()`` after each engine step's outputs with ``SchedulerStats``
and ``IterationStats`` (``vllm/v1/metrics/loggers.py``). ``record`` only keeps references; the
export thread (``vllm_export.SpanPump``) builds the spans (``vllm_steps``). Evictions come from
vLLM's KV-event stream (``vllm_kv_events``), asked for full reports where vLLM has them
(``report_mode``: reused blocks too, tagged by request, which tell a preempted request's own blocks
coming back from a prefix hit), the cold start from ``vllm_coldstart``. The offline
``LLM`` class takes no stat-logger plugins.

Settings are environment variables (docs/vllm.md): ``TOKENTRACE_COLLECTOR_URL`` (default
``http://127.0.0.1:4318``), ``TOKENTRACE_INSTANCE_ID`` (default ``vllm-<host>-<pid>``),
``TOKENTRACE_SPOOL_DIR`` (default: the engine shim's spool directory; empty: no spool) and
``TOKENTRACE_VLLM_DISABLE=1``. Nothing here raises into vLLM: a failure turns a feature off and is
logged once; a registered custom logger also makes vLLM collect stats (``log_stats``) at all.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from collections import deque
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from tokentrace import contract as c
from tokentrace.engine_shim.emit import encode
from tokentrace.engine_shim.emit.defaults import default_spool_dir
from tokentrace.engine_shim.vllm.coldstart import (
    DEFAULT_COLLECTOR,
    ENV_COLLECTOR,
    ENV_INSTANCE,
    ENV_SPOOL_DIR,
    disabled,
    load_context,
)
from tokentrace.engine_shim.vllm.compat import Compat, check_vllm
from tokentrace.engine_shim.vllm.export import SpanEvent, SpanPump, SpanRecord
from tokentrace.engine_shim.vllm.kv_events import (
    Eviction,
    KvCacheTracker,
    KvEventSubscriber,
    subscriber_endpoint,
)
from tokentrace.engine_shim.vllm.names import client_request_id
from tokentrace.engine_shim.vllm.prompts import Abort, PromptLog, Refusal
from tokentrace.engine_shim.vllm.prompts import install as watch_prompts
from tokentrace.engine_shim.vllm.report_mode import install as ask_for_full_reports
from tokentrace.engine_shim.vllm.steps import (
    StepWindow,
    abort_record,
    cache_records,
    engine_intake_s,
    heartbeat_record,
    refusal_record,
    request_record,
)
from tokentrace.hardware import vllm_resource

# A child of vLLM's logger: vLLM configures "vllm" only (its handler, format and level; no
# propagation), so a logger outside it says nothing in vLLM's log while it serves.
log = logging.getLogger("vllm.tokentrace")

HEARTBEAT_S = 5.0


class _Runtime:
    """What one vLLM API-server process shares between its per-engine stat loggers."""

    def __init__(self, vllm_config: Any) -> None:
        self.compat: Compat = check_vllm()
        if self.compat.problems:
            log.warning("tokentrace: %s", " | ".join(self.compat.problems))
        self.config = vllm_config
        self.collector = os.environ.get(ENV_COLLECTOR, DEFAULT_COLLECTOR).rstrip("/")
        self.spool_dir = os.environ.get(ENV_SPOOL_DIR, default_spool_dir()) or None
        self.instance = os.environ.get(ENV_INSTANCE) or f"vllm-{socket.gethostname()}-{os.getpid()}"
        self.model = str(_get(vllm_config, "model_config.served_model_name", "") or "")
        self.block_bytes_per_token = _kv_bytes_per_token(vllm_config)
        self.engine_block = _get(vllm_config, "cache_config.block_size")
        self.prompts = PromptLog()
        self.prompts.on_refusal = self.refused
        self.prompts.on_abort = self.aborted
        try:
            watching = watch_prompts(self.prompts)
        except Exception:
            log.exception("tokentrace: could not watch vLLM's prompts; no fingerprints or refusals")
            watching = False
        self.pumps: dict[int, SpanPump] = {}
        self.load_reported = False
        self.first_response = threading.Event()
        atexit.register(self.close)
        _announce(self.instance, watching)

    def close(self) -> None:
        """Flush every pump; runs at interpreter exit (vLLM's API server exits normally on SIGTERM)."""
        for pump in self.pumps.values():
            pump.close()

    def refused(self, refusal: Refusal) -> None:
        """A request the frontend answered with an error before any engine saw it (API-server
        process: one for all engines)."""
        self.pump(0).submit(refusal_record(refusal, self.model))

    def aborted(self, abort: Abort) -> None:
        """A request aborted before its engine finished it (the client went away)."""
        self.pump(0).submit(abort_record(abort, client_request_id, self.model))

    def pump(self, engine_index: int) -> SpanPump:
        if engine_index not in self.pumps:
            instance = self.instance if engine_index == 0 else f"{self.instance}/dp{engine_index}"
            resource = {
                c.SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", "vllm"),
                c.SERVICE_INSTANCE_ID: instance,
                c.HOST_NAME: socket.gethostname(),
                c.ENGINE: c.ENGINE_VLLM,
                c.ENGINE_VERSION: self.compat.version,
                c.MODEL: self.model,
                # vLLM's FinishedRequestStats time every part; load_wait is 0 by construction (docs/vllm.md).
                c.OBSERVER_MEASURES: list(c.OBSERVER_PARTS),
                **vllm_resource(),
            }
            pump = SpanPump(self.collector, resource, spool_dir=self.spool_dir)
            pump.start()
            self.pumps[engine_index] = pump
        return self.pumps[engine_index]

    def report_load(self) -> None:
        """Emit ``model.load`` (process start -> engine ready) once, and give TRACEPARENT back."""
        context = load_context()
        if self.load_reported or context is None:
            return
        self.load_reported = True
        trace_id, span_id, parent, start_ns, previous = context
        now = time.time_ns()
        self.pump(0).submit(SpanRecord(
            c.SPAN_MODEL_LOAD, start_ns, now,
            # The load id is the trace id: vLLM's own loading spans share the trace but cannot
            # carry our attribute, and the collector names their stages by it (docs/vllm.md).
            {c.LOAD_ID: f"{trace_id:032x}", c.LOAD_LAZY: False,
             c.MODEL_PATH: str(_get(self.config, "model_config.model", ""))},
            [SpanEvent(c.EVENT_STARTED, start_ns), SpanEvent(c.EVENT_READY, now)],
            trace_id=trace_id, span_id=span_id, parent_span_id=parent,
        ))
        # vLLM parents each llm_request span to TRACEPARENT when the request carried no trace
        # context (vllm/tracing/otel.py::_get_smart_context); requests are not part of the load.
        if previous:
            os.environ["TRACEPARENT"] = previous
        else:
            os.environ.pop("TRACEPARENT", None)


_RUNTIME: _Runtime | None = None
_RUNTIME_LOCK = threading.Lock()


def _runtime(vllm_config: Any) -> _Runtime:
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = _Runtime(vllm_config)
        return _RUNTIME


def _get(obj: Any, dotted: str, default: Any = None) -> Any:
    for name in dotted.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return default
    return obj


def _kv_bytes_per_token(vllm_config: Any) -> int | None:
    """2 x layers x kv_heads x head_dim x dtype bytes (DESIGN §3), or None if vLLM hides it."""
    try:
        import torch

        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        dtype = vllm_config.cache_config.cache_dtype
        itemsize = model.dtype.itemsize if dtype == "auto" else torch.empty((), dtype=getattr(
            torch, {"fp8": "float8_e4m3fn"}.get(dtype, dtype))).element_size()
        return 2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * \
            model.get_head_size() * itemsize
    except Exception:
        return None


#: The line on vLLM's /metrics that tells a tokentrace gateway in front of this vLLM that the plugin
#: reports its requests itself (engine_shim/gateway/adapters/vllm.py reads it; docs/gateway.md).
PLUGIN_METRIC = "tokentrace_plugin_info"


def _announce(instance: str, prompts: bool) -> None:
    """Register ``tokentrace_plugin_info{instance=...,prompts="1"|"0"} 1`` in this process's
    Prometheus registry (the one vLLM's /metrics serves with a single API server); ``prompts``: the
    plugin sends each prompt's fingerprint itself (a gateway in front then sends none)."""
    try:
        from prometheus_client import Gauge

        Gauge(PLUGIN_METRIC, "the tokentrace plugin reports this vLLM's requests",
              ["instance", "prompts"]).labels(instance, "1" if prompts else "0").set(1)
    except Exception:  # a second registration, or no prometheus_client: only detection is lost
        log.debug("tokentrace: %s not registered", PLUGIN_METRIC, exc_info=True)


class TokentraceStatLogger(StatLoggerBase):
    """vLLM stat logger that reports requests, steps, heartbeats and evictions to tokentrace."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.errors = 0  #: exceptions swallowed in record()
        self._finished: deque[tuple[float, Any]] = deque(maxlen=100_000)
        self._steps = StepWindow()
        self._latest: Any = None
        self._last_heartbeat = 0.0
        self._subscriber: KvEventSubscriber | None = None
        self._tracker: KvCacheTracker | None = None
        self._report_mode: str | None = None  #: full / incremental, with the KV-event subscriber
        self._preempted_hits: int | None = None  #: vLLM's PrefixCacheStats.preempted_hits, summed
        self._runtime: _Runtime | None = None
        if disabled():
            return
        try:
            self._runtime = _runtime(vllm_config)
            self._pump = self._runtime.pump(engine_index)
            self._pump.add_source(self._collect)
            if "evictions" in self._runtime.compat.features:
                self._start_kv_events(vllm_config)
        except Exception:
            log.exception("tokentrace: the vLLM plugin could not start; vLLM serves without it")
            self._runtime = None

    def _start_kv_events(self, vllm_config: Any) -> None:
        config = _get(vllm_config, "kv_events_config")
        if not (config and config.enable_kv_cache_events and config.publisher == "zmq"):
            log.info("tokentrace: no --kv-events-config with the zmq publisher: no eviction rows")
            return
        address, bind = subscriber_endpoint(config.endpoint, self.engine_index)
        self._tracker = KvCacheTracker()
        self._subscriber = KvEventSubscriber(
            address, config.topic, self._tracker, self._on_evictions, bind=bind
        )
        self._subscriber.start()
        try:
            self._report_mode = ask_for_full_reports()
        except Exception:
            log.exception("tokentrace: could not ask vLLM for full KV-event reports; running incremental")
            self._report_mode = "incremental"

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        """Called by vLLM after each engine step's outputs: keep references, build nothing."""
        if self._runtime is None:
            return
        try:
            now = iteration_stats.iteration_timestamp if iteration_stats is not None else time.time()
            if iteration_stats is not None:
                for finished in iteration_stats.finished_requests:
                    self._finished.append((now, finished))
            if scheduler_stats is not None:
                self._latest = scheduler_stats
                prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
                preempted_hits = getattr(prefix, "preempted_hits", None)
                if preempted_hits is not None:
                    self._preempted_hits = (self._preempted_hits or 0) + int(preempted_hits)
                details = getattr(scheduler_stats, "iteration_details", None)
                if details is not None and not details.is_dummy:
                    self._steps.add(now, details)
        except Exception:
            self.errors += 1
            if self.errors == 1:
                log.exception("tokentrace: record() failed; counting further failures silently")

    def log_engine_initialized(self) -> None:
        """Called once the engine is up: the end of the cold start."""
        if self._runtime is not None:
            self._runtime.report_load()

    def _collect(self, now_ns: int, final: bool) -> list[SpanRecord]:
        runtime = self._runtime
        assert runtime is not None
        records = []
        while self._finished:
            ts, finished = self._finished.popleft()
            first = not runtime.first_response.is_set()
            runtime.first_response.set()
            reuse = self._tracker.take(str(finished.request_id)) if self._tracker is not None else None
            intake = engine_intake_s(finished, runtime.prompts.take_times(str(finished.request_id)), ts,
                                     time.time() - time.monotonic())
            record = request_record(ts, finished, client_request_id, runtime.model, first, reuse, intake)
            records.append(record)
            records.extend(cache_records(record, finished, runtime.prompts.take(str(finished.request_id)),
                                         runtime.engine_block))
        records.extend(self._steps.flush(now_ns, force=final))
        if self._latest is not None and (final or now_ns / 1e9 - self._last_heartbeat >= HEARTBEAT_S):
            self._last_heartbeat = now_ns / 1e9
            records.append(heartbeat_record(
                now_ns, self._latest, runtime.config, runtime.block_bytes_per_token,
                self._tracker.entries if self._tracker is not None else None,
                self._report_mode, self._preempted_hits,
            ))
        return records

    def _on_evictions(self, evictions: list[Eviction]) -> None:
        runtime = self._runtime
        assert runtime is not None
        block_bytes = (runtime.block_bytes_per_token or 0) * evictions[0].tokens or None
        entries = evictions[-1].entries_after
        state = encode.cache_state(c.UNIT_BLOCK, entries, entries * block_bytes if block_bytes else None)
        events = [SpanEvent(c.EVENT_CACHE_EVICT, ev.time_ns, encode.eviction(
            unit=c.UNIT_BLOCK, tokens=ev.tokens, reason=c.EVICT_MAX_BYTES, fingerprint=ev.fingerprint,
            nbytes=block_bytes, entries_after=ev.entries_after,
            bytes_after=ev.entries_after * block_bytes if block_bytes else None,
        )) for ev in evictions]
        time_ns = evictions[0].time_ns
        self._pump.submit(SpanRecord(c.SPAN_CACHE_TRIM, time_ns, time_ns, dict(state), events))
