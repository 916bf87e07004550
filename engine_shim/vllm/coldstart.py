"""The cold-start half of the vLLM plugin: the ``vllm.general_plugins`` hook, which imports no vLLM.

vLLM loads general plugins in every process, first in the API-server process while it builds its
argument parser, before any model work (``vllm/engine/arg_utils.py``; ``vllm/plugins/__init__.py``).
In that first process only, :func:`register` picks the ids of this instance's ``model.load`` span
and puts them in ``TRACEPARENT``: vLLM's own loading spans (``Load weights``, ``Allocate KV cache``,
``Warmup (CPU)``, ... exported with ``--otlp-traces-endpoint``) in the engine and worker processes,
which inherit the environment, then become its children (``vllm/tracing/otel.py::
_get_smart_context``). It also puts this instance's identity in ``OTEL_RESOURCE_ATTRIBUTES``, so that
vLLM's own spans name the same instance as the plugin's. The stat logger emits ``model.load``
itself once the engine is up (``vllm_plugin``).
"""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.parse

from tokentrace import contract as c
from tokentrace.engine_shim.vllm.export import new_span_id, new_trace_id

ENV_COLLECTOR = "TOKENTRACE_COLLECTOR_URL"
ENV_INSTANCE = "TOKENTRACE_INSTANCE_ID"
ENV_DISABLE = "TOKENTRACE_VLLM_DISABLE"
#: Where the plugin's undeliverable batches wait (empty: nowhere); the engine shim's default.
ENV_SPOOL_DIR = "TOKENTRACE_SPOOL_DIR"
#: Internal: "<trace id>-<span id>-<parent span id>-<start ns>-<TRACEPARENT before us>" of model.load.
ENV_LOAD = "TOKENTRACE_VLLM_LOAD"
DEFAULT_COLLECTOR = "http://127.0.0.1:4318"


def disabled() -> bool:
    """Whether the operator switched the plugin off (``TOKENTRACE_VLLM_DISABLE=1``)."""
    return os.environ.get(ENV_DISABLE, "").lower() in ("1", "true", "yes")


def _process_start_ns() -> int:
    """When this process started, on the wall clock. On Linux from its start in clock ticks since
    boot (``/proc/self/stat``) against ``CLOCK_BOOTTIME``: within a tick (10 ms). psutil's
    ``create_time`` adds a boot time read in whole seconds there, and put a restarted vLLM's load up
    to a second before requests its predecessor served (the cache verdict then could not call the
    cold cache after it a restart). Elsewhere psutil (a vLLM dependency), else now."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time_ns() - int(age * 1e9)
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        return int(psutil.Process().create_time() * 1e9)
    except Exception:
        return time.time_ns()


def _otlp_endpoint_from_argv(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--otlp-traces-endpoint" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--otlp-traces-endpoint="):
            return arg.split("=", 1)[1]
    return None


def register() -> None:
    """``vllm.general_plugins`` hook: prepare the cold-start trace and the shared resource."""
    if disabled() or ENV_LOAD in os.environ:
        return  # a child process (the environment is inherited), or switched off
    # vLLM accepts either spelling (vllm/tracing/otel.py::_get_smart_context).
    previous = os.environ.get("TRACEPARENT") or os.environ.get("traceparent") or ""  # noqa: SIM112
    parts = previous.split("-")
    trace_id, parent_span = new_trace_id(), 0
    if len(parts) == 4 and len(parts[1]) == 32 and len(parts[2]) == 16:
        trace_id, parent_span = int(parts[1], 16), int(parts[2], 16)
    span_id = new_span_id()
    ids = f"{trace_id:032x}-{span_id:016x}-{parent_span:016x}"
    os.environ[ENV_LOAD] = f"{ids}-{_process_start_ns()}-{previous}"
    os.environ["TRACEPARENT"] = f"00-{trace_id:032x}-{span_id:016x}-01"
    os.environ.pop("traceparent", None)  # vLLM reads the lower-case name first
    instance = os.environ.setdefault(ENV_INSTANCE, f"vllm-{socket.gethostname()}-{os.getpid()}")
    _merge_resource_env({
        c.SERVICE_INSTANCE_ID: instance, c.ENGINE: c.ENGINE_VLLM, c.HOST_NAME: socket.gethostname(),
    })
    # vLLM's exporter defaults to gRPC; our collector speaks OTLP/HTTP, whose traces URL ends in
    # /v1/traces. Only that unambiguous case is switched, and only if the user chose nothing.
    endpoint = _otlp_endpoint_from_argv(sys.argv)
    if endpoint and endpoint.rstrip("/").endswith("/v1/traces"):
        os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")


def _merge_resource_env(attrs: dict[str, str]) -> None:
    current = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    keys = {item.split("=", 1)[0].strip() for item in current.split(",") if "=" in item}
    extra = [f"{k}={urllib.parse.quote(v, safe='')}" for k, v in attrs.items() if k not in keys]
    os.environ["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(filter(None, [current, *extra]))


def load_context() -> tuple[int, int, int, int, str] | None:
    """(trace id, span id, parent span id, start ns, TRACEPARENT before us) of ``model.load``,
    or None when :func:`register` did not run in this process tree."""
    raw = os.environ.get(ENV_LOAD)
    if not raw:
        return None
    trace, span, parent, start, previous = raw.split("-", 4)
    return int(trace, 16), int(span, 16), int(parent, 16), int(start), previous
