"""Shared fixtures. Each part of the product keeps its harness in its own module, imported here."""

from harness_collector import collector_factory  # noqa: F401
from harness_store import chdb_dir  # noqa: F401
