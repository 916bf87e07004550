"""Composition of the collector process: the store it opens and the routers its app serves."""

from __future__ import annotations

from fastapi import FastAPI

from tokentrace.collector.receiver.app import Collector, create_app
from tokentrace.collector.receiver.budget import BodyDeadline
from tokentrace.collector.settings import CollectorConfig
from tokentrace.collector.stores import open_store as _open


def open_store(config: CollectorConfig):
    """The store named by the settings: --store, or the DuckDB file --db."""
    store = _open(config.store, config.retention)
    if hasattr(store, "limit_memory"):
        store.limit_memory(config.store_memory_bytes)
    if hasattr(store, "hold_unmerged"):  # the rest of the budget: requests being read and parsed
        store.hold_unmerged(config.max_pending_bytes * 3 // 4)
    if config.max_disk_bytes is not None:
        store.limit_disk(config.max_disk_bytes)
    return store


def build_app(config: CollectorConfig, store) -> FastAPI:
    """The collector's ASGI app over an open store: receiver, health, verdict API, dashboard."""
    from tokentrace.analyzers.api import router as verdicts
    from tokentrace.dashboards.prometheus import MetricsState
    from tokentrace.dashboards.prometheus import router as metrics
    from tokentrace.dashboards.routes import router as dashboard

    collector = Collector(config, store)
    app = create_app(collector)
    app.state.metrics = MetricsState(store, config.slo)
    collector.listeners.append(app.state.metrics)
    app.include_router(verdicts)
    app.include_router(metrics)
    app.include_router(dashboard)
    # Outermost: a body that stops arriving is cut off whatever it was sent to (collector/receiver/budget.py).
    app.add_middleware(BodyDeadline, timeout=config.body_timeout, min_rate=config.body_min_rate,
                       count=lambda: collector.counters.reject("body_timeout"), arrivals=collector.arrivals)
    return app
