"""Composition of the collector process: the store it opens and the routers its app serves."""

from __future__ import annotations

from fastapi import FastAPI

from tokentrace.collector.app import Collector, create_app
from tokentrace.collector.settings import CollectorConfig
from tokentrace.collector.store_duckdb import DuckDBStore


def open_store(config: CollectorConfig) -> DuckDBStore:
    """The store named by the settings (DuckDB file)."""
    return DuckDBStore(config.db)


def build_app(config: CollectorConfig, store) -> FastAPI:
    """The collector's ASGI app over an open store: receiver, health, verdict API, dashboard."""
    from tokentrace.analyzers.api import router as verdicts
    from tokentrace.dashboards.routes import router as dashboard

    app = create_app(Collector(config, store))
    app.include_router(verdicts)
    app.include_router(dashboard)
    return app
