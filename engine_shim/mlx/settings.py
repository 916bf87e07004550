"""The engine's settings: one table (option, type, default, environment variable, help), turned into
CLI options and validated at startup in one clear line each (STYLE §15)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tokentrace.engine_shim.emit.defaults import default_spool_dir
from tokentrace.engine_shim.emit.settings_table import Setting, add_arguments, read_values
from tokentrace.errors import ConfigError
from tokentrace.listen import is_loopback

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
    Setting("cache-max-bytes", int, 1 << 30, "prompt-cache byte limit (0: no prompt cache); a distributed engine "
            "counts the bytes of the rank holding the most KV per token (docs/cluster.md)", minimum=0),
    Setting("default-max-tokens", int, 512, "completion limit when a request gives none", minimum=1),
    Setting("lazy-load", bool, False, "load the model on the first request instead of at start"),
    Setting("capture-content", bool, False, "attach bounded prompt snippets to spans (off: no text leaves)"),
    Setting("heartbeat-interval", float, 5.0, "seconds between instance.heartbeat spans", minimum=0.1),
    Setting("api-key", str, None, "clients must send 'Authorization: Bearer KEY' (vLLM's --api-key)"),
    Setting("insecure-no-api-key", bool, False, "allow a --host beyond loopback without --api-key"),
    Setting("allowed-origins", str, "*", "CORS origins allowed, comma-separated ('*': any)"),
    Setting("max-request-bytes", int, 8 << 20, "largest request body accepted (413 beyond)", minimum=1),
    Setting("max-messages", int, 2048, "most chat messages in one request (400 beyond)", minimum=1),
    Setting("keepalive-interval", float, 5.0, "seconds between SSE keep-alive comments while no token comes",
            minimum=0.01),
    Setting("prompt-concurrency", int, None, "sequences prefilling at once (default: --max-batch)", minimum=1),
    Setting("temp", float, 0.0, "default sampling temperature (0: greedy)", minimum=0),
    Setting("top-p", float, 1.0, "default nucleus sampling top-p", minimum=0),
    Setting("top-k", int, 0, "default top-k sampling (0: off)", minimum=0),
    Setting("min-p", float, 0.0, "default min-p sampling (0: off)", minimum=0),
    Setting("memory-bandwidth-gbs", float, None, "peak memory bandwidth of this machine in GB/s, for the decode "
            "verdict (default: the chip's published figure; none on Linux)", minimum=0.001),
    Setting("chat-template", str, None, "chat template (Jinja text) to render chats with instead of the model's "
            "(as mlx_lm.server's --chat-template)"),
    Setting("chat-template-args", str, None, "JSON object of extra chat-template arguments, e.g. "
            "'{\"enable_thinking\":false}'"),
    Setting("use-default-chat-template", bool, False, "use the tokenizer's default chat template when it has none"),
    Setting("adapter-path", str, None, "LoRA adapter directory applied to the model"),
    Setting("trust-remote-code", bool, False, "allow code from the model directory (model and tokenizer)"),
    Setting("log-level", str, "INFO", "DEBUG, INFO, WARNING, ERROR or CRITICAL"),
    Setting("ranks", int, None, "run as this many ranks of one distributed instance on this host, over MLX's "
            "ring backend on 127.0.0.1 (under mlx.launch the launcher gives the ranks)", minimum=1),
    Setting("parallel", str, "auto", "placement of a distributed engine: pipeline (layers per rank), tensor (a "
            "shard of every layer) or auto (pipeline where the model can split its layers, else tensor)"),
    Setting("rank-timeout", float, 10.0, "a distributed engine's step or hand-over that has not completed after "
            "this many seconds stalls the instance: its open requests fail naming the rank, new ones get 503 until "
            "the ring moves again (0: wait forever; a rank whose process exited fails them regardless)", minimum=0),
    Setting("control-port", int, 0, "under mlx.launch, the TCP port on rank 0's address in the host list where the "
            "other ranks' control connections (their heartbeats, beside the ring) arrive (0: a free port; set one to "
            "open it in a firewall)", minimum=0, maximum=65535),
    Setting("timed-step-every", int, 8, "a pipeline rank times one engine step in this many: its layers' compute "
            "and its waits on the ring (0: none; the others keep mlx-lm's overlap of steps)", minimum=0),
    Setting("timed-step-gap", float, 0.25, "... at most one each this many seconds; the first step of each "
            "request's prefill and of its decode is timed whatever the gap", minimum=0),
    Setting("split", str, None, "pipeline layer counts per rank, rank 0 first, e.g. 10,6 (default: even; rank 0 "
            "holds the last layers)"),
)

#: Options of mlx_lm.server with another name here (docs/engine.md, "Coming from mlx_lm.server").
ALIASES = {"max-tokens": "default-max-tokens", "decode-concurrency": "max-batch",
           "prompt-cache-size": "cache-max-entries", "prompt-cache-bytes": "cache-max-bytes"}


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
    cache_max_bytes: int = 1 << 30  #: prompt-cache byte limit (distributed: the most-holding rank's bytes)
    default_max_tokens: int = 512  #: completion limit when a request gives none
    lazy_load: bool = False  #: load on the first request
    capture_content: bool = False  #: prompt snippets in spans
    heartbeat_interval: float = 5.0  #: seconds between heartbeats
    api_key: str | None = None  #: bearer key clients must send
    insecure_no_api_key: bool = False  #: allow a non-loopback bind without an API key
    allowed_origins: str = "*"  #: CORS origins, comma-separated
    max_request_bytes: int = 8 << 20  #: request body limit
    max_messages: int = 2048  #: chat message limit
    keepalive_interval: float = 5.0  #: SSE keep-alive period
    prompt_concurrency: int | None = None  #: sequences prefilling at once
    temp: float = 0.0  #: default temperature
    top_p: float = 1.0  #: default top-p
    top_k: int = 0  #: default top-k
    min_p: float = 0.0  #: default min-p
    chat_template: str | None = None  #: chat template override
    chat_template_args: str | None = None  #: JSON object of chat template arguments
    use_default_chat_template: bool = False  #: tokenizer's default template when it has none
    adapter_path: str | None = None  #: LoRA adapters
    trust_remote_code: bool = False  #: allow model code
    log_level: str = "INFO"  #: logging level
    memory_bandwidth_gbs: float | None = None  #: declared peak memory bandwidth (GB/s)
    ranks: int | None = None  #: ranks to start on this host (distributed engine)
    parallel: str = "auto"  #: pipeline, tensor or auto
    split: str | None = None  #: pipeline layer counts per rank
    rank_timeout: float = 10.0  #: seconds a ring operation may take before the instance is stalled
    control_port: int = 0  #: rank 0's control-plane port under mlx.launch (0: a free one)
    timed_step_every: int = 8  #: a pipeline rank times one step in this many (0: none)
    timed_step_gap: float = 0.25  #: ... at most one each this many seconds (and each request's first of a phase)

    @property
    def distributed(self) -> bool:
        """Whether this process is (or starts) a rank of a distributed instance."""
        from tokentrace.engine_shim.mlx.cluster import under_launcher

        return (self.ranks or 1) > 1 or under_launcher()

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

    @property
    def origins(self) -> list[str]:
        """Allowed CORS origins."""
        return [origin.strip() for origin in self.allowed_origins.split(",") if origin.strip()]

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """--chat-template-args, decoded (validated at startup)."""
        return json.loads(self.chat_template_args) if self.chat_template_args else {}


def add_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per setting (plus mlx_lm.server's name for it); environment variables provide
    the defaults."""
    add_arguments(parser, SETTINGS, ALIASES)


def settings_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> EngineSettings:
    """Option, else environment variable, else default; each value checked. Raises ConfigError."""
    values = read_values(args, SETTINGS, os.environ if environ is None else environ, _convert)
    if not values["model"]:
        raise ConfigError("--model is required (a model directory; `tokentrace make-model DIR` writes one)")
    _check(values)
    known = {f.name for f in fields(EngineSettings)}
    return EngineSettings(**{k: v for k, v in values.items() if k in known})


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _check(values: dict[str, Any]) -> None:
    """Checks across settings, and of values beyond a type and a minimum."""
    values["log_level"] = str(values["log_level"]).upper()
    if values["log_level"] not in _LOG_LEVELS:
        raise ConfigError(f"--log-level must be one of {', '.join(_LOG_LEVELS)}, received {values['log_level']!r}")
    if values["top_p"] > 1 or values["min_p"] > 1:
        raise ConfigError("--top-p and --min-p must be in [0, 1]")
    if values["chat_template_args"]:
        try:
            decoded = json.loads(values["chat_template_args"])
        except ValueError as exc:
            raise ConfigError(f"--chat-template-args must be a JSON object, received invalid JSON: {exc}") from None
        if not isinstance(decoded, dict):
            raise ConfigError(f"--chat-template-args must be a JSON object, received {values['chat_template_args']!r}")
    if values["parallel"] not in ("auto", "pipeline", "tensor"):
        raise ConfigError(f"--parallel must be pipeline, tensor or auto, received {values['parallel']!r}")
    from tokentrace.engine_shim.mlx.cluster import parse_split, under_launcher

    split = parse_split(values["split"])
    ranks = values["ranks"] or 1
    if split is not None and ranks > 1 and len(split) != ranks:
        raise ConfigError(f"--split gives {len(split)} layer counts for --ranks {ranks}")
    if split is not None and values["parallel"] == "tensor":
        raise ConfigError("--split splits layers between ranks: it goes with --parallel pipeline, not tensor")
    if (ranks > 1 or under_launcher()) and values["lazy_load"]:
        raise ConfigError("--lazy-load: a distributed engine loads at start (its ranks join the ring then)")
    host = values["host"]
    if not is_loopback(host) and not values["api_key"] and not values["insecure_no_api_key"]:
        raise ConfigError(f"--host {host} serves beyond this machine: give --api-key KEY (clients send "
                          f"'Authorization: Bearer KEY'), or --insecure-no-api-key to serve without one")


_SIZES = {"": 1, "K": 1 << 10, "KB": 10**3, "KIB": 1 << 10, "M": 10**6, "MB": 10**6, "MIB": 1 << 20,
          "G": 10**9, "GB": 10**9, "GIB": 1 << 30}


def parse_size(raw: Any) -> int:
    """A byte count: an integer, or a number with a unit as mlx_lm.server's --prompt-cache-bytes
    takes it (10GB, 512M, 1.5G; GiB/MiB for powers of two)."""
    if isinstance(raw, int):
        return raw
    text = str(raw).strip().upper()
    digits = text.rstrip("KMGIB ")
    unit = text[len(digits):].strip()
    if unit not in _SIZES:
        raise ValueError(raw)
    return int(float(digits) * _SIZES[unit])


def _convert(setting: Setting, raw: Any, source: str) -> Any:
    """Byte counts take units as mlx_lm.server's do; everything else its type."""
    return parse_size(raw) if setting.option.endswith("-bytes") else setting.type(raw)
