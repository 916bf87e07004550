"""Serve an mlx-lm model over an OpenAI-compatible HTTP API and report every phase of every
request to a tokentrace collector (OTLP/HTTP), spooling to disk while the collector is away."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from tokentrace.engine_shim.mlx import mlx_server_flags
from tokentrace.engine_shim.mlx.settings import add_setting_arguments, settings_from_args
from tokentrace.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tokentrace engine`` (see engine_shim/mlx/settings.py for the table), plus
    mlx_lm.server's options that have no equivalent, so that they are refused in our words."""
    add_setting_arguments(parser)
    mlx_server_flags.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the engine until SIGINT/SIGTERM; 1 when the model cannot be loaded at start."""
    import uvicorn

    from tokentrace.engine_shim.mlx.engine import Engine
    from tokentrace.engine_shim.mlx.exporter_process import ExporterConfig, ExporterProcess, engine_resource
    from tokentrace.engine_shim.mlx.loader import looks_like_path
    from tokentrace.engine_shim.mlx.records import Clock
    from tokentrace.engine_shim.mlx.server import create_app
    from tokentrace.engine_shim.mlx.telemetry import Telemetry
    from tokentrace.listen import listen_socket

    warnings = mlx_server_flags.check(args)
    settings = settings_from_args(args)
    if looks_like_path(settings.model) and not Path(settings.model).expanduser().is_dir():
        raise ConfigError(f"--model {settings.model}: no such model directory")
    sock = listen_socket(settings.host, settings.port)  # a busy port is one line, before anything starts
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for warning in warnings:
        logging.getLogger(__name__).warning(warning)
    resource = engine_resource(settings.service_instance_id, settings.served_name, model_dir=settings.model,
                               chat_template=settings.chat_template,
                               memory_bandwidth_gbs=settings.memory_bandwidth_gbs)
    # Spans are built and exported in a process of their own (exporter_process.py explains why).
    exporter = ExporterProcess(ExporterConfig(
        resource={k: list(v) if isinstance(v, tuple | list) else v if isinstance(v, float) else str(v)
                  for k, v in resource.attributes.items()},
        endpoint=settings.otlp_endpoint or None,
        spool_dir=settings.spool_dir, spool_max_bytes=settings.spool_max_bytes, token=settings.otlp_token,
        clock_offset_ns=Clock().offset_ns,
    )).start()
    telemetry = Telemetry(exporter, heartbeat_interval=settings.heartbeat_interval)
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
        server.run(sockets=[sock])
    finally:
        telemetry.close()  # idempotent: the server's shutdown closed it unless startup failed
    lost = exporter.counters.dropped_spans
    records = exporter.dropped_records + telemetry.dropped
    if lost or records:
        print(f"tokentrace engine: {lost} spans and {records} records were dropped", file=sys.stderr)
    if engine.state == "failed" and not settings.lazy_load:
        print(f"tokentrace engine: error: {engine.scheduler.load_record.error}", file=sys.stderr)
        return 1
    return 0
