"""Collector settings: one table (name, default, environment variable, help), validated at start.

A command-line option wins over its environment variable, which wins over the default. An invalid
value fails fast in one line naming the setting, what was expected and what arrived.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokentrace.errors import ConfigError


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


def _non_negative(text: str) -> int:
    return _integer(text, "0 or a positive integer", 0)


def default_parse_workers() -> int:
    """One worker per core but one (the collector's own process), at most 4."""
    return max(0, min(4, (os.cpu_count() or 1) - 1))


def _token(text: str) -> str:
    if not text.strip() or any(ch.isspace() for ch in text):
        raise ValueError("a non-empty token without spaces")
    return text


@dataclass(frozen=True)
class Setting:
    """One collector setting."""

    name: str  #: attribute name; the option is --name with dashes
    default: Any  #: value when neither option nor environment sets it
    env: str  #: environment variable that sets it
    help: str  #: one line for --help and docs
    parse: Callable[[str], Any] = str  #: text -> value; ValueError says what was expected


SETTINGS: tuple[Setting, ...] = (
    Setting("db", "./tokentrace.duckdb", "TOKENTRACE_DB", "DuckDB file of the store (created if missing)"),
    Setting("host", "127.0.0.1", "TOKENTRACE_HOST", "address to bind; 127.0.0.1 keeps it on this machine"),
    Setting("port", 4318, "TOKENTRACE_PORT", "port of OTLP/HTTP, the API and the dashboard", _port),
    Setting("token", None, "TOKENTRACE_TOKEN", "bearer token required on every endpoint when set", _token),
    Setting("spool_dir", None, "TOKENTRACE_SPOOL_DIR", "directory of OTLP files to ingest (watched)"),
    Setting("max_body_bytes", 16 * 1024 * 1024, "TOKENTRACE_MAX_BODY_BYTES",
            "largest request body accepted, after decompression", _positive),
    Setting("max_queue", 256, "TOKENTRACE_MAX_QUEUE",
            "batches waiting for the writer before senders get 503 + Retry-After", _positive),
    Setting("max_attribute_length", 65536, "TOKENTRACE_MAX_ATTRIBUTE_LENGTH",
            "longer attribute strings are truncated (and reported in partial success)", _positive),
    Setting("parse_workers", None, "TOKENTRACE_PARSE_WORKERS",
            "processes that decode and normalize payloads; 0 parses in the collector (default: cores - 1, "
            "at most 4)", _non_negative),
    Setting("log_level", "info", "TOKENTRACE_LOG_LEVEL", "debug, info, warning or error"),
)


@dataclass(frozen=True)
class CollectorConfig:
    """Validated settings of one collector process."""

    db: str
    host: str
    port: int
    token: str | None
    spool_dir: str | None
    max_body_bytes: int
    max_queue: int
    max_attribute_length: int
    parse_workers: int
    log_level: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per setting; defaults are resolved later so that env vars can fill them."""
    for setting in SETTINGS:
        default = "unset" if setting.default is None else setting.default
        parser.add_argument(
            "--" + setting.name.replace("_", "-"), dest=setting.name, default=None,
            help=f"{setting.help} (default {default}; env {setting.env})",
        )


def load(args: argparse.Namespace, environ: dict[str, str] | None = None) -> CollectorConfig:
    """Resolve and validate every setting, or raise ConfigError naming the first bad one."""
    environ = os.environ if environ is None else environ
    values = {}
    for setting in SETTINGS:
        raw = getattr(args, setting.name, None)
        source = "--" + setting.name.replace("_", "-")
        if raw is None and environ.get(setting.env):
            raw, source = environ[setting.env], setting.env
        if raw is None:
            values[setting.name] = setting.default
            continue
        try:
            values[setting.name] = setting.parse(str(raw))
        except ValueError as exc:
            raise ConfigError(f"{source} must be {exc}, received {raw!r}") from None
    if values["parse_workers"] is None:
        values["parse_workers"] = default_parse_workers()
    if values["log_level"] not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"--log-level must be debug, info, warning or error, received {values['log_level']!r}")
    db_parent = Path(values["db"]).expanduser().resolve().parent
    if not db_parent.is_dir():
        raise ConfigError(f"--db must be in an existing directory, {db_parent} does not exist")
    return CollectorConfig(**values)
