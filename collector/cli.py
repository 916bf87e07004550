"""Run the collector: OTLP/HTTP receiver, store (a DuckDB file by default; ClickHouse with
--store, docs/scale-out.md), spool watcher, API and dashboard.

Binds 127.0.0.1:4318 by default. SIGINT or SIGTERM stops it cleanly: requests in flight finish,
everything submitted is committed, the store is checkpointed.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys

from tokentrace.collector import settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tokentrace collector`` (one per setting)."""
    settings.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Start the collector and serve until a signal stops it."""
    import uvicorn

    from tokentrace.collector.server import build_app, open_store
    from tokentrace.listen import listen_socket

    config = settings.load(args)
    sock = listen_socket(config.host, config.port)  # a busy port fails before the store file exists
    # Ingest allocates millions of short-lived tuples; CPython's default gen-0 threshold (700) makes
    # it collect thousands of times per second for no cycles at all. Measured ~10 % of ingest CPU.
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    store = open_store(config)
    app = build_app(config, store)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, access_log=False,
        timeout_graceful_shutdown=30, lifespan="on",
    ))
    print(f"tokentrace collector: http://{config.host}:{config.port}/ (store {store.path})", file=sys.stderr)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler that
    # was installed before it: a recording handler makes that clean stop exit 0, not -15.
    stopped_by: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _frame: stopped_by.append(number))
    server.run(sockets=[sock])
    stop_error = app.state.collector.stop_error
    if stop_error:
        print(f"tokentrace collector: error: stopping failed, the store may need its WAL replayed at the next "
              f"start: {stop_error}", file=sys.stderr)
        return 1
    return 0 if server.started else 1
