"""--retention on a ClickHouse store (chdb): whole days past the retention are dropped, the TTL is
set once per change and removed with 'off'."""

from __future__ import annotations

import time

import pytest
from harness_store import clickhouse_available, sql, unique_database
from test_collector_errors import make_request

from tokentrace.collector import stores
from tokentrace.collector.decoding.normalize import normalize

pytestmark = pytest.mark.skipif(not clickhouse_available(), reason="the clickhouse extra is not installed")
DAY = 86_400 * 10**9


def _batch(name: str, start_ns: int):
    request = make_request(3, name=name)
    for span in request.resource_spans[0].scope_spans[0].spans:
        span.start_time_unix_nano, span.end_time_unix_nano = start_ns, start_ns + 1000
    return normalize(request)


def _names(store) -> list[tuple]:
    return sql(store, "SELECT name, count() FROM spans GROUP BY name ORDER BY name")


#: The tables whose rows are not timed, so retention never drops them.
UNTIMED = {"spool_files", "store_settings", "schema_migrations"}


def _ttl_tables(store) -> int:
    [(count,)] = sql(store, "SELECT count() FROM system.tables WHERE database = currentDatabase() "
                            "AND position(engine_full, ' TTL ') > 0")
    return count


def _untimed_tables(store) -> set[str]:
    """Tables without a TTL: a timed table added to the schema but not to ttl.sql shows up here."""
    rows = sql(store, "SELECT name FROM system.tables WHERE database = currentDatabase() "
                      "AND engine LIKE '%MergeTree%' AND position(engine_full, ' TTL ') = 0")
    return {name for (name,) in rows}


def test_retention_drops_days_past_it_and_off_keeps_everything(chdb_dir):
    url = stores.parse(f"chdb://{chdb_dir}?database={unique_database('ttl')}")
    now = time.time_ns()
    store = stores.open_store(url, retention_s=2 * 86_400)
    try:
        assert _untimed_tables(store) == UNTIMED  # every timed table has the TTL
        assert store.write(_batch("today", now)) and store.write(_batch("last-week", now - 7 * DAY))
        # ClickHouse drops expired parts when it merges (usually already at insert, not always in a
        # busy session): a final merge makes the TTL's effect certain before it is checked.
        store._reader().command("OPTIMIZE TABLE spans FINAL")
        assert _names(store) == [("today", 3)]  # expired rows are gone
        assert store.counts()["resources"] == 1
    finally:
        store.close()
    store = stores.open_store(url, retention_s=2 * 86_400)  # unchanged: nothing altered, nothing recorded
    try:
        assert sql(store, "SELECT count() FROM store_settings") == [(1,)]
    finally:
        store.close()
    store = stores.open_store(url, retention_s=0)
    try:
        assert _ttl_tables(store) == 0
        assert store.write(_batch("last-week", now - 7 * DAY))
        assert _names(store) == [("last-week", 3), ("today", 3)]
    finally:
        store.close()
    store = stores.open_store(url)  # no --retention: the store keeps what it has
    try:
        assert _ttl_tables(store) == 0 and sql(store, "SELECT count() FROM store_settings") == [(2,)]
    finally:
        store.close()
