"""Shared fixtures. Each part of the product keeps its harness in its own module, imported here."""

# --- collector processes; dashboard (issue 5): Debian's headless Chromium ---------------------------
from harness_browser import browser_page, chromium  # noqa: F401
from harness_collector import collector_factory  # noqa: F401

# --- engine (issue 3): tiny model, engine processes ----------------------------------------------
from harness_engine import engine_factory, tiny_model  # noqa: F401
from harness_store import chdb_dir  # noqa: F401

# --- vLLM shim (issue 6): --skip-vllm and the session-scoped real-vLLM fixture ---------------------
from vllm_fixtures import add_options, skip_if_asked, vllm_run  # noqa: F401


def pytest_addoption(parser):
    """Command-line options of the test suite."""
    add_options(parser)


def pytest_collection_modifyitems(config, items):
    """Skip vllm-marked tests only when --skip-vllm is given (never silently)."""
    skip_if_asked(config, items)
