"""Which store a ``--store`` URL names, and opening it.

    duckdb:///abs/file.duckdb, duckdb://rel.duckdb   embedded DuckDB file, the default (--db FILE)
    chdb:///abs/dir[?database=NAME]                  ClickHouse in-process (chdb); one process per dir
    clickhouse://[USER[:PASSWORD]@]HOST[:PORT]/DB[?SETTING=VALUE&...]
                                                     ClickHouse server over HTTP (port 8123);
                                                     clickhouses:// is HTTPS (port 8443)

The location is the text after ``scheme://``, so three slashes give an absolute path. Query
parameters of a server URL become ClickHouse settings of every query (e.g.
``async_insert=1&wait_for_async_insert=1``, docs/scale-out.md). The database is created if missing;
its default is ``tokentrace``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

from tokentrace.errors import StoreError

SCHEMES = ("duckdb", "chdb", "clickhouse", "clickhouses")
DEFAULT_DATABASE = "tokentrace"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SETTING = re.compile(r"[a-z_][a-z0-9_]*")


@dataclass(frozen=True)
class StoreURL:
    """A parsed ``--store`` value."""

    scheme: str  #: one of SCHEMES
    location: str  #: file or directory path (duckdb, chdb) or host (servers)
    database: str = DEFAULT_DATABASE  #: ClickHouse database
    port: int | None = None  #: server port
    username: str = "default"  #: server user
    password: str = ""  #: server password
    settings: tuple[tuple[str, str], ...] = ()  #: ClickHouse settings from the query string

    @property
    def clickhouse(self) -> bool:
        """Whether this is a ClickHouse backend (chdb or a server)."""
        return self.scheme != "duckdb"


def parse(text: str) -> StoreURL:
    """Parse and validate; ValueError says what a store URL must look like."""
    expected = "a store URL: duckdb:///FILE, chdb:///DIR or clickhouse://HOST:8123/DB"
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(expected)
    if scheme in ("duckdb", "chdb"):
        location, _, query = rest.partition("?")
        if not location:
            raise ValueError(expected + " (the path is missing)")
        if scheme == "duckdb" and query:
            raise ValueError(expected + " (duckdb takes no query parameters)")
        params = dict(parse_qsl(query, keep_blank_values=True))
        database = params.pop("database", DEFAULT_DATABASE)
        if params:
            raise ValueError(expected + " (chdb takes only ?database=NAME)")
        if not _IDENTIFIER.fullmatch(database):
            raise ValueError("a database name of letters, digits and underscores")
        return StoreURL(scheme, location, database)
    parts = urlsplit(text)
    try:
        port = parts.port or (8443 if scheme == "clickhouses" else 8123)
    except ValueError:
        raise ValueError(expected + " (the port is not a number)") from None
    database = parts.path.strip("/") or DEFAULT_DATABASE
    if not parts.hostname or not _IDENTIFIER.fullmatch(database):
        raise ValueError(expected + " (a host, and a database of letters, digits and underscores)")
    settings = tuple(parse_qsl(parts.query, keep_blank_values=True))
    if any(not _SETTING.fullmatch(name) for name, _ in settings):
        raise ValueError(expected + " (query parameters are ClickHouse setting names)")
    return StoreURL(scheme, parts.hostname, database, port, unquote(parts.username or "default"),
                    unquote(parts.password or ""), settings)


def check_location(url: StoreURL) -> str | None:
    """A problem with where a local store would be created, or None."""
    if url.scheme not in ("duckdb", "chdb"):  # a server: nothing local
        return None
    parent = Path(url.location).expanduser().resolve().parent
    return None if parent.is_dir() else f"{parent} does not exist"


def open_store(url: StoreURL, retention_s: int | None = None):
    """Open (and migrate) the store ``url`` names; both roles in one object. ``retention_s``: seconds
    to keep (0: everything; None: what the store has), whole days for ClickHouse."""
    if not url.clickhouse:
        from tokentrace.collector.stores.store_duckdb import DuckDBStore

        store = DuckDBStore(url.location)
        if retention_s is not None:
            store.retain(retention_s)
        return store
    try:
        from tokentrace.collector.stores.store_clickhouse import ClickHouseStore, Target
    except ImportError as exc:
        raise StoreError(f"--store {url.scheme}:// needs the clickhouse extra: "
                         f"pip install 'tokentrace[clickhouse]' ({exc})") from exc
    if url.scheme == "chdb":
        target = Target(url.database, path=str(Path(url.location).expanduser().resolve()))
    else:
        target = Target(url.database, host=url.location, port=url.port, username=url.username,
                        password=url.password, secure=url.scheme == "clickhouses", settings=dict(url.settings))
    return ClickHouseStore(target, None if retention_s is None else retention_s // 86_400)
