"""Shared fixtures. Each part of the product keeps its harness in its own module, imported here."""

# --- collector processes; dashboard (issue 5): Debian's headless Chromium ---------------------------
from harness_browser import browser_page, chromium  # noqa: F401
from harness_collector import collector_factory  # noqa: F401

# --- engine (issue 3): tiny model, engine processes ----------------------------------------------
from harness_engine import engine_factory, tiny_model  # noqa: F401
from harness_store import chdb_dir  # noqa: F401

# --- vLLM shim (issue 6): --skip-vllm and the session-scoped real-vLLM fixture ---------------------
from vllm_fixtures import add_options, skip_if_asked, vllm_run  # noqa: F401


def pytest_configure(config):
    """Ctrl-C works in every process the tests start, however the suite itself was started: a suite
    run as a background job of a non-interactive shell (``bash tests/run &``) inherits SIGINT
    ignored, every process it starts inherits that, and the tests that stop an engine or the demo
    with Ctrl-C (SIGINT to the group) then wait for a process that never hears it."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser):
    """Command-line options of the test suite."""
    add_options(parser)


def pytest_collection_modifyitems(config, items):
    """Skip vllm-marked tests only when --skip-vllm is given (never silently)."""
    skip_if_asked(config, items)
