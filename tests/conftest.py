"""Shared fixtures. Each part of the product keeps its harness in its own module, imported here."""

from harness_collector import collector_factory  # noqa: F401

# --- engine (issue 3): tiny model, engine processes ----------------------------------------------
from harness_engine import engine_factory, tiny_model  # noqa: F401
