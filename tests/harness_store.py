"""Real stores for tests, one per backend: a DuckDB file, or a database in chdb's embedded engine.

chdb runs one engine per process on one data directory, so every in-process chdb store of a test
session lives in one directory (``chdb_dir``) and gets a database of its own; a store releases the
engine when it closes. Tests that need a ClickHouse server read ``TOKENTRACE_CLICKHOUSE_URL`` and are
skipped, with that reason, when it is not set.
"""

from __future__ import annotations

import itertools
import os
from urllib.parse import quote, urlencode

import pytest

from tokentrace.collector import stores

BACKENDS = ("duckdb", "chdb")
SERVER_ENV = "TOKENTRACE_CLICKHOUSE_URL"
_databases = itertools.count()


def clickhouse_available() -> bool:
    """Whether the optional clickhouse extra (clickhouse-connect, chdb) is installed."""
    try:
        import chdb  # noqa: F401
        import clickhouse_connect  # noqa: F401
    except ImportError:
        return False
    return True


#: Backends a collector process is tested on (``collector_store``); chdb needs the clickhouse extra.
COLLECTOR_BACKENDS = ["duckdb", pytest.param("chdb", marks=pytest.mark.skipif(
    not clickhouse_available(), reason="the clickhouse extra is not installed (pip install -e '.[clickhouse]')"))]


def collector_store(backend: str, tmp_path) -> str | None:
    """The ``--store`` URL of a fresh store of ``backend`` for a collector process; None for DuckDB,
    whose default (``--db`` in the test's directory) the collector harness already gives."""
    return f"chdb://{tmp_path / 'chdb'}" if backend == "chdb" else None


def server_url() -> str:
    """The ClickHouse server to test against, or skip the test saying the server path did not run."""
    url = os.environ.get(SERVER_ENV)
    if not url:
        pytest.skip(f"server path NOT run: set {SERVER_ENV}=clickhouse://HOST:8123/DB to test against a "
                    "real ClickHouse server (none can be installed on this machine)")
    return url


def server_database_url(prefix: str) -> str:
    """The test server's URL with a fresh database in place of its own (settings kept)."""
    url = stores.parse(server_url())
    credentials = f"{quote(url.username)}:{quote(url.password)}@" if url.password else f"{quote(url.username)}@"
    query = f"?{urlencode(url.settings)}" if url.settings else ""
    return f"{url.scheme}://{credentials}{url.location}:{url.port}/{unique_database(prefix)}{query}"


def unique_database(prefix: str = "t") -> str:
    """A database name no other store of this session uses."""
    return f"{prefix}_{os.getpid()}_{next(_databases)}"


@pytest.fixture(scope="session")
def chdb_dir(tmp_path_factory):
    """The one chdb data directory of this test process."""
    if not clickhouse_available():
        pytest.skip("the clickhouse extra is not installed (pip install -e '.[clickhouse]')")
    return tmp_path_factory.mktemp("chdb")


def sql(store, query: str, **params) -> list[tuple]:
    """Ad-hoc SQL on an open ClickHouse store, for assertions the reader role has no query for."""
    return store._reader().query(query, parameters=params or None).result_rows


def store_url(backend: str, tmp_path, chdb_dir) -> stores.StoreURL:
    """A fresh, empty store of ``backend``."""
    if backend == "duckdb":
        return stores.parse(f"duckdb://{tmp_path / f'{unique_database()}.duckdb'}")
    if backend == "chdb":
        return stores.parse(f"chdb://{chdb_dir}?database={unique_database()}")
    return stores.parse(server_database_url("t"))
