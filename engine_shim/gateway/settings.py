"""The gateway's settings: one table (option, type, default, environment variable, help), turned
into CLI options and validated at startup in one clear line each (STYLE §15).

``--upstream NAME=URL`` and ``--adapter NAME=KIND`` repeat; their environment variables hold
comma-separated lists.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from tokentrace import contract as c
from tokentrace.engine_shim.emit.defaults import default_spool_dir
from tokentrace.errors import ConfigError

POLICIES = (c.POLICY_ROUND_ROBIN, c.POLICY_LEAST_LOADED, c.POLICY_SESSION, c.POLICY_PREFIX)


@dataclass(frozen=True)
class Setting:
    """One gateway setting."""

    option: str  #: CLI option without the leading dashes
    type: type  #: str, int, float, bool (a flag) or list (repeatable NAME=VALUE)
    default: Any  #: value when neither the option nor the environment variable is given
    help: str  #: one line for --help and docs
    minimum: float | None = None  #: smallest accepted value for numbers
    choices: tuple[str, ...] = ()  #: accepted values for text, when closed

    @property
    def env(self) -> str:
        """Environment variable that sets the default, e.g. TOKENTRACE_GATEWAY_ROUTE."""
        return "TOKENTRACE_GATEWAY_" + self.option.upper().replace("-", "_")

    @property
    def attr(self) -> str:
        """Attribute name on GatewaySettings."""
        return self.option.replace("-", "_")


SETTINGS: tuple[Setting, ...] = (
    Setting("upstream", list, (), "an upstream engine as NAME=URL (repeat); NAME becomes its instance id"),
    Setting("adapter", list, (), "skip detection: NAME=KIND for an upstream (kinds: see docs/gateway.md)"),
    Setting("route", str, c.POLICY_ROUND_ROBIN, "routing policy", choices=POLICIES),
    Setting("host", str, "127.0.0.1", "address to bind"),
    Setting("port", int, 8080, "port to bind", minimum=1),
    Setting("api-key", str, None, "clients must send Authorization: Bearer KEY (required off loopback)"),
    Setting("insecure-no-api-key", bool, False, "allow binding off loopback without --api-key"),
    Setting("otlp-endpoint", str, "http://127.0.0.1:4318",
            "collector base URL; spans go to ENDPOINT/v1/traces ('' disables export)"),
    Setting("otlp-token", str, None, "bearer token the collector requires, if any"),
    Setting("otlp-timeout", float, 10.0, "seconds one span export may take before its batch goes to the spool",
            minimum=0.1),
    Setting("spool-dir", str, default_spool_dir(),
            "where span batches wait while the collector is unreachable (the collector's --spool-dir)"),
    Setting("spool-max-bytes", int, 256 << 20, "spool size limit; batches beyond it are dropped and counted",
            minimum=0),
    Setting("tokenizer", str, None, "tokenizer directory (tokenizer.json) for fingerprints in model tokens"),
    Setting("block-size", int, c.DEFAULT_BLOCK_SIZE, "tokens (or bytes, without a tokenizer) per fingerprint block",
            minimum=1),
    Setting("max-concurrency", int, 8, "requests in flight per upstream; more wait at the gateway (queueing)",
            minimum=1),
    Setting("prefix-load-bound", float, 1.5,
            "prefix policy: skip an upstream whose in-flight count exceeds this times the least loaded + 1",
            minimum=1.0),
    Setting("rate-limit", float, 0.0, "requests per second per client (API key or address); 0: unlimited",
            minimum=0.0),
    Setting("connect-timeout", float, 2.0, "seconds to connect to an upstream before trying another",
            minimum=0.01),
    Setting("request-timeout", float, 600.0, "seconds an upstream may take between bytes before the request fails",
            minimum=0.01),
    Setting("poll-interval", float, 5.0, "seconds between health/state polls of each upstream", minimum=0.05),
    Setting("down-after", int, 1, "consecutive failures that mark an upstream down", minimum=1),
    Setting("capture-content", bool, False, "attach bounded prompt snippets to spans (off: no text leaves)"),
)


@dataclass(frozen=True)
class GatewaySettings:
    """Validated gateway settings; field names are the options with underscores."""

    upstream: tuple[tuple[str, str], ...] = ()  #: (name, base URL) per upstream, in order
    adapter: tuple[tuple[str, str], ...] = ()  #: (name, adapter kind) that skip detection
    route: str = c.POLICY_ROUND_ROBIN  #: routing policy
    host: str = "127.0.0.1"  #: bind address
    port: int = 8080  #: bind port
    api_key: str | None = None  #: bearer key clients must send
    insecure_no_api_key: bool = False  #: allow non-loopback bind without a key
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
    for setting in SETTINGS:
        help_text = f"{setting.help} [env {setting.env}]"
        if setting.type is bool:
            parser.add_argument(f"--{setting.option}", action="store_true", default=None, help=help_text)
        elif setting.type is list:
            parser.add_argument(f"--{setting.option}", action="append", default=None, metavar="NAME=VALUE",
                                help=help_text)
        else:
            shown = "" if setting.default is None else f" (default: {setting.default})"
            parser.add_argument(f"--{setting.option}", default=None, metavar=setting.option.upper().replace("-", "_"),
                                choices=setting.choices or None, help=help_text + shown)


def settings_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> GatewaySettings:
    """Option, else environment variable, else default; each value checked. Raises ConfigError."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        raw = getattr(args, setting.attr, None)
        source = f"--{setting.option}"
        if raw is None and setting.env in environ:
            raw, source = environ[setting.env], setting.env
            if setting.type is list:
                raw = [part for part in raw.split(",") if part.strip()]
        values[setting.attr] = setting.default if raw is None else _parse(setting, raw, source)
    settings = GatewaySettings(**values)
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
    if not settings.api_key and not settings.insecure_no_api_key and not is_loopback(settings.host):
        raise ConfigError(f"--host {settings.host} is not a loopback address: set --api-key (or, knowingly, "
                          "--insecure-no-api-key)")


def is_loopback(host: str) -> bool:
    """Whether ``host`` binds only the local machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_KINDS = {int: "an integer", float: "a number", str: "text"}


def _parse(setting: Setting, raw: Any, source: str) -> Any:
    if setting.type is list:
        return tuple(_pair(setting, item, source) for item in raw)
    if setting.type is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{source} must be true or false, received {raw!r}")
    try:
        value = setting.type(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{source} must be {_KINDS[setting.type]}, received {raw!r}") from None
    if setting.minimum is not None and value < setting.minimum:
        raise ConfigError(f"{source} must be {_KINDS[setting.type]} >= {setting.minimum:g}, received {raw!r}")
    if setting.choices and value not in setting.choices:
        raise ConfigError(f"{source} must be one of {', '.join(setting.choices)}, received {raw!r}")
    return value


def _pair(setting: Setting, item: str, source: str) -> tuple[str, str]:
    name, sep, value = item.strip().partition("=")
    if not sep or not name or not value:
        raise ConfigError(f"{source} must be NAME=VALUE, received {item!r}")
    if setting.option == "upstream":
        url = urlparse(value)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ConfigError(f"{source} {name}: URL must be http(s)://host:port, received {value!r}")
        value = value.rstrip("/").removesuffix("/v1")
    return name, value
