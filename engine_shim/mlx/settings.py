"""The engine's settings: one table (option, type, default, environment variable, help), turned into
CLI options and validated at startup in one clear line each (STYLE §15)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tokentrace.engine_shim.emit.defaults import default_spool_dir
from tokentrace.errors import ConfigError


@dataclass(frozen=True)
class Setting:
    """One engine setting."""

    option: str  #: CLI option without the leading dashes
    type: type  #: str, int, float or bool (bool: a flag)
    default: Any  #: value when neither the option nor the environment variable is given
    help: str  #: one line for --help and docs
    minimum: float | None = None  #: smallest accepted value for numbers

    @property
    def env(self) -> str:
        """Environment variable that sets the default, e.g. TOKENTRACE_ENGINE_MAX_BATCH."""
        return "TOKENTRACE_ENGINE_" + self.option.upper().replace("-", "_")

    @property
    def attr(self) -> str:
        """Attribute name on EngineSettings."""
        return self.option.replace("-", "_")


SETTINGS: tuple[Setting, ...] = (
    Setting("model", str, None, "model directory in mlx-lm format (or a hub id) to serve; required"),
    Setting("model-name", str, None, "model id served at /v1/models (default: the directory name)"),
    Setting("instance-id", str, None, "service.instance.id of this engine (default: HOSTNAME:PORT)"),
    Setting("host", str, "127.0.0.1", "address to bind"),
    Setting("port", int, 8000, "port to bind", minimum=1),
    Setting("otlp-endpoint", str, "http://127.0.0.1:4318",
            "collector base URL; spans go to ENDPOINT/v1/traces ('' disables export)"),
    Setting("otlp-token", str, None, "bearer token the collector requires, if any"),
    Setting("spool-dir", str, default_spool_dir(),
            "where span batches wait while the collector is unreachable (the collector's --spool-dir)"),
    Setting("spool-max-bytes", int, 256 << 20, "spool size limit; batches beyond it are dropped and counted",
            minimum=0),
    Setting("max-batch", int, 8, "sequences generated concurrently (continuous batching)", minimum=1),
    Setting("prefill-step-size", int, 2048, "prompt tokens per prefill chunk", minimum=1),
    Setting("cache-max-entries", int, 16, "prompt-cache entry limit (0: no prompt cache)", minimum=0),
    Setting("cache-max-bytes", int, 1 << 30, "prompt-cache byte limit (0: no prompt cache)", minimum=0),
    Setting("default-max-tokens", int, 512, "completion limit when a request gives none", minimum=1),
    Setting("lazy-load", bool, False, "load the model on the first request instead of at start"),
    Setting("capture-content", bool, False, "attach bounded prompt snippets to spans (off: no text leaves)"),
    Setting("heartbeat-interval", float, 5.0, "seconds between instance.heartbeat spans", minimum=0.1),
    Setting("memory-bandwidth-gbs", float, None, "peak memory bandwidth of this machine in GB/s, for the decode "
            "verdict (default: the chip's published figure; none on Linux)", minimum=0.001),
    Setting("chat-template", str, None, "chat template (Jinja text) to render chats with instead of the model's "
            "(as mlx_lm.server's --chat-template)"),
)


@dataclass(frozen=True)
class EngineSettings:
    """Validated engine settings; field names are the options with underscores."""

    model: str  #: model directory or hub id
    model_name: str | None = None  #: id served at /v1/models
    instance_id: str | None = None  #: service.instance.id
    host: str = "127.0.0.1"  #: bind address
    port: int = 8000  #: bind port
    otlp_endpoint: str = "http://127.0.0.1:4318"  #: collector base URL ('' disables export)
    otlp_token: str | None = None  #: collector bearer token
    spool_dir: str = default_spool_dir()  #: spool directory for undeliverable span batches
    spool_max_bytes: int = 256 << 20  #: spool size limit
    max_batch: int = 8  #: concurrent sequences
    prefill_step_size: int = 2048  #: prompt tokens per prefill chunk
    cache_max_entries: int = 16  #: prompt-cache entry limit
    cache_max_bytes: int = 1 << 30  #: prompt-cache byte limit
    default_max_tokens: int = 512  #: completion limit when a request gives none
    lazy_load: bool = False  #: load on the first request
    capture_content: bool = False  #: prompt snippets in spans
    heartbeat_interval: float = 5.0  #: seconds between heartbeats
    memory_bandwidth_gbs: float | None = None  #: declared peak memory bandwidth (GB/s)
    chat_template: str | None = None  #: chat template replacing the model's

    @property
    def served_name(self) -> str:
        """The model id clients see."""
        return self.model_name or Path(self.model.rstrip("/")).name or self.model

    @property
    def service_instance_id(self) -> str:
        """service.instance.id: --instance-id, or host:port."""
        if self.instance_id:
            return self.instance_id
        import socket

        return f"{socket.gethostname()}:{self.port}"


def add_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per setting; environment variables provide the defaults."""
    for setting in SETTINGS:
        help_text = f"{setting.help} [env {setting.env}]"
        if setting.type is bool:
            parser.add_argument(f"--{setting.option}", action="store_true", default=None, help=help_text)
        else:
            shown = "" if setting.default is None else f" (default: {setting.default})"
            parser.add_argument(f"--{setting.option}", default=None, metavar=setting.option.upper().replace("-", "_"),
                                help=help_text + shown)


def settings_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> EngineSettings:
    """Option, else environment variable, else default; each value checked. Raises ConfigError."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        raw = getattr(args, setting.attr, None)
        source = f"--{setting.option}"
        if raw is None and setting.env in environ:
            raw, source = environ[setting.env], setting.env
        values[setting.attr] = setting.default if raw is None else _parse(setting, raw, source)
    if not values["model"]:
        raise ConfigError("--model is required (a model directory; `tokentrace make-model DIR` writes one)")
    known = {f.name for f in fields(EngineSettings)}
    return EngineSettings(**{k: v for k, v in values.items() if k in known})


_KINDS = {int: "an integer", float: "a number", str: "text"}


def _parse(setting: Setting, raw: Any, source: str) -> Any:
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
    return value
