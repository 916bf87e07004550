"""The gateway's settings: one table (option, type, default, environment variable, help), turned
into CLI options and validated at startup in one clear line each (STYLE §15).

``--upstream NAME=URL``, ``--adapter NAME=KIND`` and ``--upstream-key NAME=KEY`` repeat; their
environment variables hold comma-separated lists.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import urlparse

from tokentrace import contract as c
from tokentrace.engine_shim.emit.defaults import default_spool_dir
from tokentrace.engine_shim.emit.settings_table import Setting, add_arguments, read_values
from tokentrace.errors import ConfigError
from tokentrace.listen import is_loopback

POLICIES = (c.POLICY_ROUND_ROBIN, c.POLICY_LEAST_LOADED, c.POLICY_SESSION, c.POLICY_PREFIX)


#: A row of the gateway's table: its environment variables are TOKENTRACE_GATEWAY_*.
_row = partial(Setting, prefix="TOKENTRACE_GATEWAY_")


SETTINGS: tuple[Setting, ...] = (
    _row("upstream", list, (), "an upstream engine as NAME=URL (repeat); NAME becomes its instance id"),
    _row("adapter", list, (), "skip detection: NAME=KIND for an upstream (kinds: see docs/gateway.md)"),
    _row("upstream-key", list, (), "NAME=KEY: the key an upstream requires (its --api-key), sent to it as "
            "Authorization: Bearer KEY (repeat)"),
    _row("route", str, c.POLICY_ROUND_ROBIN, "routing policy", choices=POLICIES),
    _row("host", str, "127.0.0.1", "address to bind"),
    _row("port", int, 8080, "port to bind", minimum=1),
    _row("api-key", str, None, "clients must send Authorization: Bearer KEY (required off loopback)"),
    _row("insecure-no-api-key", bool, False, "allow binding off loopback without --api-key"),
    _row("max-request-bytes", int, 8 << 20, "largest request body accepted (413 beyond), as the engine's",
            minimum=1),
    _row("max-pending-bytes", int, 256 << 20, "bytes of request bodies the gateway holds at once, each counted "
            "twice (the body and its parsed JSON) until its answer ends; past it 503 + Retry-After", minimum=1),
    _row("body-timeout", float, 10.0, "seconds a request body may take to arrive, plus 1 s per --body-min-rate "
            "bytes received; a slower body is cut off with 408", minimum=0.01),
    _row("body-min-rate", int, 1 << 20, "bytes of a request body that earn it one more second past --body-timeout "
            "(its minimum rate, bytes/s)", minimum=1),
    _row("otlp-endpoint", str, "http://127.0.0.1:4318",
            "collector base URL; spans go to ENDPOINT/v1/traces ('' disables export)"),
    _row("otlp-token", str, None, "bearer token the collector requires, if any"),
    _row("otlp-timeout", float, 10.0, "seconds one span export may take before its batch goes to the spool",
            minimum=0.1),
    _row("spool-dir", str, default_spool_dir(),
            "where span batches wait while the collector is unreachable (the collector's --spool-dir)"),
    _row("spool-max-bytes", int, 256 << 20, "spool size limit; batches beyond it are dropped and counted",
            minimum=0),
    _row("tokenizer", str, None, "tokenizer directory (tokenizer.json) for fingerprints in model tokens"),
    _row("block-size", int, c.DEFAULT_BLOCK_SIZE, "tokens (or bytes, without a tokenizer) per fingerprint block",
            minimum=1),
    _row("max-concurrency", int, 8, "requests in flight per upstream; more wait at the gateway (queueing)",
            minimum=1),
    _row("prefix-load-bound", float, 1.5,
            "prefix policy: skip an upstream whose in-flight count exceeds this times the least loaded + 1",
            minimum=1.0),
    _row("rate-limit", float, 0.0, "requests per second per client (API key or address); 0: unlimited",
            minimum=0.0),
    _row("connect-timeout", float, 2.0, "seconds to connect to an upstream before trying another",
            minimum=0.01),
    _row("request-timeout", float, 600.0, "seconds an upstream may take between bytes before the request fails",
            minimum=0.01),
    _row("poll-interval", float, 5.0, "seconds between health/state polls of each upstream", minimum=0.05),
    _row("down-after", int, 1, "consecutive failures that mark an upstream down", minimum=1),
    _row("capture-content", bool, False, "attach bounded prompt snippets to spans (off: no text leaves)"),
)


@dataclass(frozen=True)
class GatewaySettings:
    """Validated gateway settings; field names are the options with underscores."""

    upstream: tuple[tuple[str, str], ...] = ()  #: (name, base URL) per upstream, in order
    adapter: tuple[tuple[str, str], ...] = ()  #: (name, adapter kind) that skip detection
    upstream_key: tuple[tuple[str, str], ...] = ()  #: (name, key) of upstreams that require a key
    route: str = c.POLICY_ROUND_ROBIN  #: routing policy
    host: str = "127.0.0.1"  #: bind address
    port: int = 8080  #: bind port
    api_key: str | None = None  #: bearer key clients must send
    insecure_no_api_key: bool = False  #: allow non-loopback bind without a key
    max_request_bytes: int = 8 << 20  #: request body limit
    max_pending_bytes: int = 256 << 20  #: request bodies held at once (Gateway.bodies)
    body_timeout: float = 10.0  #: seconds a body may take beyond what body_min_rate allows
    body_min_rate: int = 1 << 20  #: bytes a second a body must keep up
    otlp_endpoint: str = "http://127.0.0.1:4318"  #: collector base URL ('' disables export)
    otlp_token: str | None = None  #: collector bearer token
    otlp_timeout: float = 10.0  #: seconds per export before spooling
    spool_dir: str = field(default_factory=default_spool_dir)  #: spool directory
    spool_max_bytes: int = 256 << 20  #: spool size limit
    tokenizer: str | None = None  #: tokenizer directory
    block_size: int = c.DEFAULT_BLOCK_SIZE  #: fingerprint block size
    max_concurrency: int = 8  #: in-flight requests per upstream
    prefix_load_bound: float = 1.5  #: prefix policy's load bound
    rate_limit: float = 0.0  #: requests/s per client (0: off)
    connect_timeout: float = 2.0  #: upstream connect timeout (s)
    request_timeout: float = 600.0  #: upstream read timeout (s)
    poll_interval: float = 5.0  #: seconds between polls
    down_after: int = 1  #: failures that mark an upstream down
    capture_content: bool = False  #: prompt snippets in spans


def add_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per setting; environment variables provide the defaults."""
    add_arguments(parser, SETTINGS)


def settings_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> GatewaySettings:
    """Option, else environment variable, else default; each value checked. Raises ConfigError."""
    settings = GatewaySettings(**read_values(args, SETTINGS, os.environ if environ is None else environ, _convert))
    _check(settings)
    return settings


def _check(settings: GatewaySettings) -> None:
    if not settings.upstream:
        raise ConfigError("--upstream is required (NAME=URL, e.g. --upstream mini-1=http://10.0.0.11:8080)")
    names = [name for name, _ in settings.upstream]
    if len(set(names)) != len(names):
        raise ConfigError(f"--upstream names must be unique, received {', '.join(names)}")
    for name, kind in settings.adapter:
        if name not in names:
            raise ConfigError(f"--adapter {name}={kind}: no --upstream named {name!r}")
        from tokentrace.engine_shim.gateway.adapters import kinds

        if kind not in kinds():
            raise ConfigError(f"--adapter {name}={kind}: unknown kind; known: {', '.join(kinds())}")
    for name, _ in settings.upstream_key:
        if name not in names:
            raise ConfigError(f"--upstream-key {name}=...: no --upstream named {name!r}")
    if len({name for name, _ in settings.upstream_key}) != len(settings.upstream_key):
        raise ConfigError("--upstream-key: one key per upstream")
    if not settings.api_key and not settings.insecure_no_api_key and not is_loopback(settings.host):
        raise ConfigError(f"--host {settings.host} is not a loopback address: set --api-key (or, knowingly, "
                          "--insecure-no-api-key)")


def _convert(setting: Setting, raw: Any, source: str) -> Any:
    """A repeatable option's items are NAME=VALUE pairs; everything else its type."""
    return _pair(setting, raw, source) if setting.type is list else setting.type(raw)


def _pair(setting: Setting, item: str, source: str) -> tuple[str, str]:
    name, sep, value = item.strip().partition("=")
    if not sep or not name or not value:
        shown = name if setting.option == "upstream-key" else item  # a key is never echoed
        raise ConfigError(f"{source} must be NAME=VALUE, received {shown!r}")
    if setting.option == "upstream":
        url = urlparse(value)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ConfigError(f"{source} {name}: URL must be http(s)://host:port, received {value!r}")
        value = value.rstrip("/").removesuffix("/v1")
    return name, value
