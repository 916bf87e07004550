"""Engine shims: the ways an engine's work reaches the collector under the telemetry contract.

- ``mlx/``: ``tokentrace engine``, an instrumented OpenAI-compatible mlx-lm server (everything
  measured inside), and a small Python API for applications that embed mlx-lm themselves;
- ``vllm/``: the vLLM plugin (vLLM's own numbers, from inside its process);
- ``emit/``: what they share: the spool, the exporter that falls back to it, defaults.

    from tokentrace.engine_shim import Instrumentation, build_chat_prompt, engine_resource

Importing this package loads neither mlx nor the OpenTelemetry SDK, and never installs a tracer
provider (STYLE §9); the names below are resolved on first use.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Instrumentation": "tokentrace.engine_shim.mlx.embed",
    "build_chat_prompt": "tokentrace.engine_shim.mlx.prompts",
    "build_text_prompt": "tokentrace.engine_shim.mlx.prompts",
    "Prompt": "tokentrace.engine_shim.mlx.prompts",
    "engine_resource": "tokentrace.engine_shim.mlx.exporter_process",
    "build_tracer_provider": "tokentrace.engine_shim.mlx.exporter_process",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tokentrace.engine_shim' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
