"""--store and --retention: the URL forms, what each opens, and one clear line for every mistake."""

from __future__ import annotations

import argparse

import pytest
from test_cli import _run

from tokentrace.collector import settings, stores
from tokentrace.errors import ConfigError


@pytest.mark.parametrize(("text", "expected"), [
    ("duckdb:///tmp/x.duckdb", stores.StoreURL("duckdb", "/tmp/x.duckdb")),
    ("duckdb://rel/x.duckdb", stores.StoreURL("duckdb", "rel/x.duckdb")),
    ("chdb:///var/lib/tt", stores.StoreURL("chdb", "/var/lib/tt")),
    ("chdb:///var/lib/tt?database=fleet_a", stores.StoreURL("chdb", "/var/lib/tt", "fleet_a")),
    ("clickhouse://ch1:8123/traces", stores.StoreURL("clickhouse", "ch1", "traces", 8123)),
    ("clickhouse://ch1", stores.StoreURL("clickhouse", "ch1", "tokentrace", 8123)),
    ("clickhouses://bob:s%40cret@ch.example:9440/t", stores.StoreURL("clickhouses", "ch.example", "t", 9440, "bob",
                                                                    "s@cret")),
    ("clickhouses://ch.example/t", stores.StoreURL("clickhouses", "ch.example", "t", 8443)),
    ("clickhouse://ch1/t?async_insert=1&wait_for_async_insert=1",
     stores.StoreURL("clickhouse", "ch1", "t", 8123, settings=(("async_insert", "1"), ("wait_for_async_insert", "1")))),
])
def test_store_urls_parse(text, expected):
    assert stores.parse(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("/tmp/x.duckdb", "a store URL"),
    ("sqlite:///x.db", "a store URL"),
    ("duckdb://", "the path is missing"),
    ("duckdb:///x.duckdb?database=a", "duckdb takes no query parameters"),
    ("chdb:///d?mode=ro", "chdb takes only ?database=NAME"),
    ("chdb:///d?database=a-b", "a database name of letters, digits and underscores"),
    ("clickhouse://ch1:port/t", "the port is not a number"),
    ("clickhouse://ch1/a;DROP", "a database of letters"),
    ("clickhouse://ch1/t?Bad-Setting=1", "query parameters are ClickHouse setting names"),
])
def test_bad_store_urls_say_what_is_expected(text, message):
    with pytest.raises(ValueError) as raised:
        stores.parse(text)
    assert message in str(raised.value)


def _load(**values) -> settings.CollectorConfig:
    return settings.load(argparse.Namespace(**values), environ={})


def test_db_is_the_default_store_and_retention_is_left_alone(tmp_path):
    config = _load(db=str(tmp_path / "a.duckdb"))
    assert config.store == stores.StoreURL("duckdb", str(tmp_path / "a.duckdb"))
    assert config.retention is None


@pytest.mark.parametrize(("text", "seconds"), [("30d", 30 * 86_400), ("1d", 86_400), ("off", 0)])
def test_retention_in_days(tmp_path, text, seconds):
    assert _load(store=f"chdb://{tmp_path}/c", retention=text).retention == seconds


@pytest.mark.parametrize(("text", "seconds"), [("30d", 30 * 86_400), ("12h", 43_200), ("90m", 5_400), ("off", 0)])
def test_a_duckdb_store_takes_hours_and_minutes_too(tmp_path, text, seconds):
    assert _load(db=str(tmp_path / "a.duckdb"), retention=text).retention == seconds


@pytest.mark.parametrize("values", [
    {"retention": "30"}, {"retention": "0d"}, {"retention": "2w"}, {"retention": "-3d"}, {"retention": "1.5h"},
    {"retention": "99999999999d"}])
def test_bad_retention(tmp_path, values):
    with pytest.raises(ConfigError, match="--retention must be a duration like 30d, 12h or 90m, or off"):
        _load(store=f"chdb://{tmp_path}/c", **values)


def test_clickhouse_retention_is_whole_days(tmp_path):
    with pytest.raises(ConfigError, match="--retention on a ClickHouse store is a number of days"):
        _load(store=f"chdb://{tmp_path}/c", retention="36h")


@pytest.mark.parametrize(("args", "message"), [
    (["--store", "duckdb:///tmp/a.duckdb", "--db", "/tmp/b.duckdb"], "--db and --store both name the store"),
    (["--store", "chdb:///tmp/x", "--max-disk-bytes", "1000000"], "--max-disk-bytes is a DuckDB store's budget"),
    (["--max-disk-bytes", "10GB"], "--max-disk-bytes must be a positive integer"),
    (["--store", "chdb:///nonexistent-dir/x"], "--store must be in an existing directory"),
    (["--store", "mysql://x"], "--store must be a store URL: duckdb:///FILE, chdb:///DIR or clickhouse://"),
    (["--store", "chdb:///tmp/x", "--retention", "forever"], "--retention must be a duration like 30d"),
])
def test_bad_store_settings_exit_2_with_one_line(args, message):
    result = _run("collector", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
