"""Serve an mlx-lm model over an OpenAI-compatible HTTP API and report every phase of every
request to a tokentrace collector (OTLP/HTTP), spooling to disk while the collector is away."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

from tokentrace import contract
from tokentrace.engine_shim.mlx import cluster, mlx_server_flags
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
    if args.mlx_pipeline:
        args.parallel = "pipeline"
    settings = settings_from_args(args)
    if looks_like_path(settings.model) and not Path(settings.model).expanduser().is_dir():
        raise ConfigError(f"--model {settings.model}: no such model directory")
    follower = settings.distributed and os.environ.get("MLX_RANK", "0") != "0"
    # A busy port is one line, before anything starts; ranks above 0 serve no API.
    sock = None if follower else listen_socket(settings.host, settings.port)
    local = None
    if settings.distributed and not cluster.under_launcher():
        # --ranks N on this host: this process becomes rank 0 and starts the others.
        local = cluster.launch_local(settings.ranks, _engine_argv())
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for warning in warnings:
        logging.getLogger(__name__).warning(warning)
    node = _node(settings)
    control = None
    if settings.distributed and local is None and not follower and int(node.get(contract.NODE_RANKS) or 0) > 1:
        # Under mlx.launch no other rank's process is at hand: a control plane beside the ring, on
        # which every rank beats, lets the watchdog name the rank that stalls it (cluster.py).
        control = cluster.ControlPlane.open(int(node[contract.NODE_RANKS]), port=settings.control_port)
    instance_id = settings.service_instance_id
    if node.get(contract.NODE_RANK):
        instance_id = contract.node_instance_id(instance_id, node[contract.NODE_RANK])
    resource = engine_resource(instance_id, settings.served_name, model_dir=settings.model,
                               chat_template=settings.chat_template,
                               memory_bandwidth_gbs=settings.memory_bandwidth_gbs)
    attributes = {k: list(v) if isinstance(v, tuple | list) else v if isinstance(v, float) else str(v)
                  for k, v in resource.attributes.items()}
    attributes.update(node)
    # Spans are built and exported in a process of their own (exporter_process.py explains why).
    exporter = ExporterProcess(ExporterConfig(
        resource=attributes,
        endpoint=settings.otlp_endpoint or None,
        spool_dir=settings.spool_dir, spool_max_bytes=settings.spool_max_bytes, token=settings.otlp_token,
        clock_offset_ns=Clock().offset_ns,
    )).start()
    telemetry = Telemetry(exporter, heartbeat_interval=settings.heartbeat_interval)
    if os.environ.get("TOKENTRACE_ENGINE_TELEMETRY") == "drop":
        # bench/cluster.py's baseline: every record thrown away before the telemetry thread (the
        # engine without its telemetry; heartbeats still tick, with nothing to report them to).
        telemetry.submit = lambda record: None
    if follower:
        return _follow(settings, telemetry, exporter)
    engine = Engine(settings, telemetry)
    if local is not None:
        engine.scheduler.diagnose = local.diagnose
        local.watch(lambda rank, code: engine.scheduler.rank_lost(
            f"rank {rank} exited ({'killed by signal ' + str(-code) if code < 0 else 'exit code ' + str(code)})"))
    elif control is not None:
        engine.scheduler.control = control
        engine.scheduler.diagnose = control.diagnose
        control.own_steps = lambda: engine.scheduler.ring_ops
    server = uvicorn.Server(uvicorn.Config(
        create_app(engine), host=settings.host, port=settings.port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=5,
    ))
    if not settings.lazy_load:
        engine.on_load_failed = lambda: setattr(server, "should_exit", True)
    ranks = f", rank 0 of {node[contract.NODE_RANKS]}" if node else ""
    print(f"tokentrace engine: serving {settings.served_name} on http://{settings.host}:{settings.port} "
          f"(instance {settings.service_instance_id}{ranks}, spans to {settings.otlp_endpoint or 'nowhere'})",
          file=sys.stderr, flush=True)
    # uvicorn stops gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler installed
    # before it; a recording handler turns that into a clean exit 0 after our own shutdown below.
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        telemetry.close()  # idempotent: the server's shutdown closed it unless startup failed
        if local is not None:
            local.stop()
        if control is not None:
            control.close()
    lost = exporter.counters.dropped_spans
    records = exporter.dropped_records + telemetry.dropped
    if lost or records:
        print(f"tokentrace engine: {lost} spans and {records} records were dropped", file=sys.stderr)
    if engine.state == "failed" and not settings.lazy_load:
        print(f"tokentrace engine: error: {engine.scheduler.load_record.error}", file=sys.stderr)
        return 1
    return 0


def _engine_argv() -> list[str]:
    """This command's options as given, for the ranks ``--ranks`` starts."""
    argv = sys.argv[1:]
    return argv[argv.index("engine") + 1:] if "engine" in argv else argv


def _node(settings) -> dict[str, object]:
    """A distributed engine's node attributes for this rank's resource (empty: one process)."""
    if not settings.distributed:
        return {}
    rank = int(os.environ.get("MLX_RANK", "0"))
    ranks = cluster.launched_ranks() or settings.ranks or 0
    return {contract.NODE_RANK: rank, contract.NODE_RANKS: ranks, contract.NODE_OF: settings.service_instance_id}


def _follow(settings, telemetry, exporter) -> int:
    """A rank above 0: load its part, follow rank 0 until it stops, export its own telemetry."""
    from tokentrace.engine_shim.mlx.follower import Follower

    # SIGTERM/SIGINT: rank 0 ends the instance and tells this rank (its next message says stop);
    # leaving the ring alone would break it for the others.
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda *_: None)
    from tokentrace.contract import EVENT_STARTED, EVENT_STOPPED
    from tokentrace.engine_shim.mlx.records import LifecycleRecord

    follower = Follower(settings, telemetry.submit)
    telemetry.heartbeat = follower.heartbeat
    telemetry.start()
    telemetry.submit(LifecycleRecord(EVENT_STARTED, time.perf_counter_ns()))
    try:
        code = follower.run()
    finally:
        # Said also when the ring broke (rank 0 gone): this rank's process ends here.
        telemetry.submit(LifecycleRecord(EVENT_STOPPED, time.perf_counter_ns()))
        telemetry.close()
    lost = exporter.counters.dropped_spans
    if lost:
        print(f"tokentrace engine (rank {os.environ.get('MLX_RANK')}): {lost} spans were dropped", file=sys.stderr)
    return code
