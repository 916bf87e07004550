"""The MLX engine shim: ``tokentrace engine`` (an instrumented, OpenAI-compatible mlx-lm server) and a
small Python API for applications that embed mlx-lm themselves.

    from tokentrace.engine_shim import Instrumentation, build_chat_prompt, engine_resource

Importing this package loads neither mlx nor the OpenTelemetry SDK, and never installs a tracer
provider (STYLE §9); the names below are resolved on first use.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Instrumentation": "tokentrace.engine_shim.embed",
    "build_chat_prompt": "tokentrace.engine_shim.prompts",
    "build_text_prompt": "tokentrace.engine_shim.prompts",
    "Prompt": "tokentrace.engine_shim.prompts",
    "engine_resource": "tokentrace.engine_shim.wiring",
    "build_tracer_provider": "tokentrace.engine_shim.wiring",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tokentrace.engine_shim' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
