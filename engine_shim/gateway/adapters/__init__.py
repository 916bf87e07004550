"""The adapter registry: kind name -> adapter class, and ``detect()``, which probes an upstream with
each class in DETECT_ORDER (most specific first) until one recognises it.

A new engine is one module under ``adapters/`` and one line in ``_CLASSES`` and ``DETECT_ORDER``;
nothing in the gateway core changes (STYLE §20, §23). Tests iterate ``ADAPTERS``.
"""

from __future__ import annotations

import importlib

import httpx

from tokentrace.engine_shim.gateway.adapters.base import Adapter, Probe

#: kind -> "module:Class", imported on first use (so that one adapter's optional imports never
#: break another's).
_CLASSES: dict[str, str] = {
    "tokentrace": "tokentrace.engine_shim.gateway.adapters.tokentrace:TokentraceEngineAdapter",
    "vllm-plugin": "tokentrace.engine_shim.gateway.adapters.vllm:VllmPluginAdapter",
    "vllm": "tokentrace.engine_shim.gateway.adapters.vllm:VllmAdapter",
    "mlx_lm": "tokentrace.engine_shim.gateway.adapters.mlx_lm:MlxLmAdapter",
    "llama.cpp": "tokentrace.engine_shim.gateway.adapters.llama_cpp:LlamaCppAdapter",
    "ollama": "tokentrace.engine_shim.gateway.adapters.ollama:OllamaAdapter",
    "exo": "tokentrace.engine_shim.gateway.adapters.exo:ExoAdapter",
    "sglang": "tokentrace.engine_shim.gateway.adapters.sglang:SglangAdapter",
    "lmstudio": "tokentrace.engine_shim.gateway.adapters.lmstudio:LmStudioAdapter",
    "openai": "tokentrace.engine_shim.gateway.adapters.openai:OpenAIAdapter",
}

#: The order ``detect()`` probes in: engines that identify themselves unambiguously first, the
#: generic OpenAI-compatible adapter (which accepts anything answering /v1/models) last.
DETECT_ORDER: tuple[str, ...] = (
    "tokentrace", "vllm-plugin", "vllm", "exo", "ollama", "sglang", "lmstudio", "mlx_lm", "llama.cpp", "openai",
)


def adapter_class(kind: str) -> type[Adapter]:
    """The adapter class registered as ``kind``; KeyError names the known kinds."""
    try:
        target = _CLASSES[kind]
    except KeyError:
        raise KeyError(f"unknown adapter kind {kind!r}; known: {', '.join(sorted(_CLASSES))}") from None
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def kinds() -> tuple[str, ...]:
    """Every registered kind."""
    return tuple(_CLASSES)


async def detect(client: httpx.AsyncClient, base_url: str) -> Probe | None:
    """The first Probe any adapter in DETECT_ORDER returns for ``base_url``; None when nothing
    answers (the upstream is down: the gateway retries detection while it polls)."""
    for kind in DETECT_ORDER:
        probe = await adapter_class(kind).probe(client, base_url)
        if probe is not None:
            return probe
    return None


__all__ = ["DETECT_ORDER", "Adapter", "Probe", "adapter_class", "detect", "kinds"]
