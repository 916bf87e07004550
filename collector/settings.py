"""Collector settings: one table (name, default, environment variable, help), validated at start.

A command-line option wins over its environment variable, which wins over the default. An invalid
value fails fast in one line naming the setting, what was expected and what arrived.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokentrace.collector import stores
from tokentrace.errors import ConfigError
from tokentrace.listen import is_loopback


def _integer(text: str, expected: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(expected) from None
    if value < low or (high is not None and value > high):
        raise ValueError(expected)
    return value


def _port(text: str) -> int:
    return _integer(text, "a TCP port between 1 and 65535", 1, 65535)


def _positive(text: str) -> int:
    return _integer(text, "a positive integer", 1)


#: What a --retention may be given in: seconds a unit.
_RETENTION_UNITS = {"d": 86_400, "h": 3_600, "m": 60}


def _retention(text: str) -> int:
    """Seconds to keep (0: everything). A ClickHouse store takes whole days (``_resolve``)."""
    if text == "off":
        return 0
    unit = _RETENTION_UNITS.get(text[-1:])
    if unit and text[:-1].isdigit() and 0 < int(text[:-1]) <= 100 * 365 * 86_400 // unit:
        return int(text[:-1]) * unit
    raise ValueError("a duration like 30d, 12h or 90m, or off")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("a number of seconds above 0") from None
    if not 0 < value < 1e6:  # NaN and infinity fail too
        raise ValueError("a number of seconds above 0")
    return value


def _non_negative(text: str) -> int:
    return _integer(text, "0 or a positive integer", 0)


def default_parse_workers() -> int:
    """One worker per core but one (the collector's own process), at most 4."""
    return max(0, min(4, (os.cpu_count() or 1) - 1))


def _yes(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("", "0", "false", "no"):
        return False
    raise ValueError("1, true, yes, 0, false or no")


def _token(text: str) -> str:
    if not text.strip() or any(ch.isspace() for ch in text):
        raise ValueError("a non-empty token without spaces")
    return text


def _slo(text: str):
    from tokentrace.analyzers.slo import parse_slo

    try:
        return parse_slo(text)
    except ConfigError as exc:
        raise ValueError(f"objectives like ttft=2s,tpot=50ms,e2e=30s, with model=NAME: or instance=NAME: "
                         f"groups after ';' (docs/metrics.md): {str(exc).removeprefix('--slo: ')}") from None


@dataclass(frozen=True)
class Setting:
    """One collector setting."""

    name: str  #: attribute name; the option is --name with dashes
    default: Any  #: value when neither option nor environment sets it
    env: str  #: environment variable that sets it
    help: str  #: one line for --help and docs
    parse: Callable[[str], Any] = str  #: text -> value; ValueError says what was expected
    flag: bool = False  #: a flag without a value on the command line (its variable takes 1 or 0)


SETTINGS: tuple[Setting, ...] = (
    Setting("db", "./tokentrace.duckdb", "TOKENTRACE_DB", "DuckDB file of the store (created if missing)"),
    Setting("store", None, "TOKENTRACE_STORE",
            "store URL instead of --db: duckdb:///FILE, chdb:///DIR or clickhouse://HOST:8123/DB", stores.parse),
    Setting("retention", None, "TOKENTRACE_RETENTION",
            "drop data older than this (30d, 12h, 90m; ClickHouse stores: whole days), or off to keep "
            "everything; the store remembers it, and unset leaves the store's retention as it is", _retention),
    Setting("max_disk_bytes", None, "TOKENTRACE_MAX_DISK_BYTES",
            "DuckDB stores: bytes the store may use on disk (its file's used blocks, WAL, journal, span "
            "files and quarantine); past it senders get 503 + Retry-After until retention or an operator "
            "frees room", _positive),
    Setting("host", "127.0.0.1", "TOKENTRACE_HOST", "address to bind; 127.0.0.1 keeps it on this machine"),
    Setting("port", 4318, "TOKENTRACE_PORT", "port of OTLP/HTTP, the API and the dashboard", _port),
    Setting("token", None, "TOKENTRACE_TOKEN", "bearer token required on every endpoint when set", _token),
    Setting("insecure_no_token", False, "TOKENTRACE_INSECURE_NO_TOKEN",
            "serve a --host other than loopback without --token: anyone who reaches it may read and write "
            "traces", _yes, flag=True),
    Setting("spool_dir", None, "TOKENTRACE_SPOOL_DIR", "directory of OTLP files to ingest (watched)"),
    Setting("max_body_bytes", 16 * 1024 * 1024, "TOKENTRACE_MAX_BODY_BYTES",
            "largest request body accepted, after decompression", _positive),
    Setting("max_queue", 256, "TOKENTRACE_MAX_QUEUE",
            "batches waiting for the writer before senders get 503 + Retry-After", _positive),
    Setting("max_pending_bytes", 256 * 1024 * 1024, "TOKENTRACE_MAX_PENDING_BYTES",
            "bytes that requests being read, parsed or written may hold (6 x each body) before senders "
            "get 503 + Retry-After", _positive),
    Setting("body_timeout", 10.0, "TOKENTRACE_BODY_TIMEOUT",
            "seconds a request body may take to arrive, plus 1 s per --body-min-rate bytes received; a slower "
            "body is cut off with 408 and its share of --max-pending-bytes given back", _seconds),
    Setting("body_min_rate", 1024 * 1024, "TOKENTRACE_BODY_MIN_RATE",
            "bytes of a request body that earn it one more second past --body-timeout (its minimum rate, "
            "bytes/s)", _positive),
    Setting("store_memory_bytes", 256 * 1024 * 1024, "TOKENTRACE_STORE_MEMORY_BYTES",
            "DuckDB stores: memory DuckDB may use for its cache and queries before it evicts or spills to "
            "disk", _positive),
    Setting("max_attribute_length", 65536, "TOKENTRACE_MAX_ATTRIBUTE_LENGTH",
            "longer attribute strings are truncated (and reported in partial success)", _positive),
    Setting("parse_workers", None, "TOKENTRACE_PARSE_WORKERS",
            "processes that normalize the payloads the compiled decoder leaves to Python (JSON, rare values); "
            "0 normalizes them in the collector (default: cores - 1, at most 4)", _non_negative),
    Setting("decode_nice", 10, "TOKENTRACE_DECODE_NICE",
            "how much lower than the collector's the scheduling priority of its payload-decoding threads is "
            "(Linux nice, 0-19), so that the store's one merge thread gets a core first; 0 leaves them equal",
            lambda text: _integer(text, "an integer from 0 to 19", 0, 19)),
    Setting("slo", None, "TOKENTRACE_SLO",
            "service-level objectives, e.g. ttft=2s,tpot=50ms;model=NAME:ttft=1s (docs/metrics.md)", _slo),
    Setting("log_level", "info", "TOKENTRACE_LOG_LEVEL", "debug, info, warning or error"),
)


@dataclass(frozen=True)
class CollectorConfig:
    """Validated settings of one collector process."""

    db: str
    store: stores.StoreURL  #: --store, or duckdb:// of --db when it is not given
    retention: int | None  #: seconds to keep (0: everything); None leaves the store's retention alone
    max_disk_bytes: int | None  #: the DuckDB store's disk budget (None: only the disk's own room)
    host: str
    port: int
    token: str | None
    insecure_no_token: bool  #: bind beyond loopback without a token, on purpose
    spool_dir: str | None
    max_body_bytes: int
    max_queue: int
    max_pending_bytes: int
    body_timeout: float  #: seconds a body may take beyond what body_min_rate allows (budget.BodyDeadline)
    body_min_rate: int  #: bytes a second a body must keep up
    store_memory_bytes: int
    max_attribute_length: int
    parse_workers: int
    decode_nice: int  #: nice added to the decoding threads' (ingest.Pipeline)
    slo: Any  #: analyzers.slo.SloSpec, or None
    log_level: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per setting; defaults are resolved later so that env vars can fill them."""
    for setting in SETTINGS:
        default = "unset" if setting.default is None else setting.default
        if setting.flag:
            parser.add_argument("--" + setting.name.replace("_", "-"), dest=setting.name, default=None,
                                action="store_const", const="1", help=f"{setting.help} (env {setting.env}=1)")
            continue
        shown = "" if "(default" in setting.help else f"default {default}; "  # a help that says its own default
        parser.add_argument(
            "--" + setting.name.replace("_", "-"), dest=setting.name, default=None,
            help=f"{setting.help} ({shown}env {setting.env})",
        )


def load(args: argparse.Namespace, environ: dict[str, str] | None = None) -> CollectorConfig:
    """Resolve and validate every setting, or raise ConfigError naming the first bad one."""
    environ = os.environ if environ is None else environ
    values, given = {}, set()
    for setting in SETTINGS:
        raw = getattr(args, setting.name, None)
        source = "--" + setting.name.replace("_", "-")
        if raw is None and environ.get(setting.env):
            raw, source = environ[setting.env], setting.env
        if raw is None:
            values[setting.name] = setting.default
            continue
        given.add(setting.name)
        try:
            values[setting.name] = setting.parse(str(raw))
        except ValueError as exc:
            raise ConfigError(f"{source} must be {exc}, received {raw!r}") from None
    if values["parse_workers"] is None:
        values["parse_workers"] = default_parse_workers()
    if values["log_level"] not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"--log-level must be debug, info, warning or error, received {values['log_level']!r}")
    _check_store(values, given)
    _check_exposure(values)
    if values["spool_dir"]:
        from tokentrace.collector.receiver.spool import check_directory

        check_directory(values["spool_dir"])
    return CollectorConfig(**values)


def _check_exposure(values: dict) -> None:
    """A collector reachable from other machines needs a token, or the operator's explicit word."""
    if values["token"] is None and not values["insecure_no_token"] and not is_loopback(values["host"]):
        raise ConfigError(f"--host {values['host']} is reachable from other machines: give --token (or "
                          "TOKENTRACE_TOKEN), or --insecure-no-token to serve it to anyone on purpose")


def _check_store(values: dict, given: set[str]) -> None:
    """Resolve --store from --db when absent; refuse contradictions in one line."""
    option = "--store"
    if values["store"] is None:
        values["store"], option = stores.StoreURL("duckdb", values["db"]), "--db"
    elif "db" in given:
        raise ConfigError("--db and --store both name the store; give one of them")
    problem = stores.check_location(values["store"])
    if problem:
        raise ConfigError(f"{option} must be in an existing directory, {problem}")
    if values["retention"] and values["store"].clickhouse and values["retention"] % 86_400:
        raise ConfigError("--retention on a ClickHouse store is a number of days like 30d: it drops whole "
                          "daily parts")
    if values["max_disk_bytes"] is not None and values["store"].clickhouse:
        raise ConfigError("--max-disk-bytes is a DuckDB store's budget; a ClickHouse server's disk is its own "
                          "(its storage policy and TTL)")
