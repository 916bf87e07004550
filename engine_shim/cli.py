"""Serve an mlx-lm model over an OpenAI-compatible HTTP API and report every phase of every
request to a tokentrace collector (OTLP/HTTP), spooling to disk while the collector is away."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from tokentrace.engine_shim.settings import add_setting_arguments, settings_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tokentrace engine`` (see engine_shim/settings.py for the table)."""
    add_setting_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the engine until SIGINT/SIGTERM; 1 when the model cannot be loaded at start."""
    import uvicorn
    from tokentrace.engine_shim.engine import Engine
    from tokentrace.engine_shim.server import create_app
    from tokentrace.engine_shim.telemetry import Telemetry
    from tokentrace.engine_shim.wiring import build_tracer_provider, engine_resource

    settings = settings_from_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The OTLP exporter logs every failed batch; ours logs the outage once and spools instead.
    logging.getLogger("opentelemetry.exporter.otlp.proto.http").setLevel(logging.CRITICAL)
    logging.getLogger("opentelemetry.exporter.otlp.common").setLevel(logging.CRITICAL)
    resource = engine_resource(settings.service_instance_id, settings.served_name)
    provider, exporter = build_tracer_provider(resource, settings.otlp_endpoint, settings.spool_dir,
                                               settings.spool_max_bytes, settings.otlp_token)
    telemetry = Telemetry(provider, heartbeat_interval=settings.heartbeat_interval)
    engine = Engine(settings, telemetry)
    server = uvicorn.Server(uvicorn.Config(
        create_app(engine), host=settings.host, port=settings.port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=5,
    ))
    if not settings.lazy_load:
        engine.on_load_failed = lambda: setattr(server, "should_exit", True)
    print(f"tokentrace engine: serving {settings.served_name} on http://{settings.host}:{settings.port} "
          f"(instance {settings.service_instance_id}, spans to {settings.otlp_endpoint or 'nowhere'})",
          file=sys.stderr, flush=True)
    # uvicorn stops gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler installed
    # before it; a recording handler turns that into a clean exit 0 after our own shutdown below.
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda *_: None)
    try:
        server.run()
    finally:
        provider.shutdown()
    if exporter.dropped_spans:
        print(f"tokentrace engine: {exporter.dropped_spans} spans were dropped (spool full)", file=sys.stderr)
    if engine.state == "failed" and not settings.lazy_load:
        print(f"tokentrace engine: error: {engine.scheduler.load_record.error}", file=sys.stderr)
        return 1
    return 0
