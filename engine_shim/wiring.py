"""OpenTelemetry SDK wiring for processes that own their telemetry (the engine CLI, the benchmark).

Never called on import and never installs a global provider (STYLE §9): the provider built here
is handed explicitly to ``Telemetry``. Embedding applications wire their own SDK instead.
"""

from __future__ import annotations

import socket

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from tokentrace import contract as c
from tokentrace.engine_shim.spool import Spool, SpoolingSpanExporter

#: Batches leave twice a second, so a collector sees a finished request within about a second.
EXPORT_DELAY_MS = 500
#: Finished spans the batch processor may hold; a request is ~10 spans.
EXPORT_QUEUE = 32768
#: An insert can evict many entries at once; each eviction is an event.
MAX_EVENTS = 4096


def engine_resource(instance_id: str, model: str, service_name: str = "tokentrace-engine") -> Resource:
    """The contract's resource attributes for an mlx-lm engine instance."""
    try:
        from mlx_lm import __version__ as engine_version
    except ImportError:  # pragma: no cover - the engine needs mlx-lm anyway
        engine_version = "unknown"
    return Resource.create({
        c.SERVICE_NAME: service_name,
        c.SERVICE_INSTANCE_ID: instance_id,
        c.HOST_NAME: socket.gethostname(),
        c.ENGINE: c.ENGINE_MLX,
        c.ENGINE_VERSION: engine_version,
        c.MODEL: model,
    })


def build_tracer_provider(
    resource: Resource, endpoint: str | None, spool_dir: str | None, spool_max_bytes: int, token: str | None = None,
) -> tuple[TracerProvider, SpoolingSpanExporter]:
    """A provider exporting OTLP/HTTP protobuf to ``endpoint`` with a spool behind it."""
    name = str(resource.attributes.get(c.SERVICE_INSTANCE_ID, "engine"))
    spool = Spool(spool_dir, spool_max_bytes, name) if spool_dir else None
    exporter = SpoolingSpanExporter(endpoint or None, spool, token=token)
    provider = TracerProvider(resource=resource, span_limits=SpanLimits(max_events=MAX_EVENTS))
    provider.add_span_processor(BatchSpanProcessor(
        exporter, schedule_delay_millis=EXPORT_DELAY_MS, max_queue_size=EXPORT_QUEUE, max_export_batch_size=512))
    return provider, exporter
