"""The engine registry of the collector's normalizer: which engine translates which native span.

Spans of the telemetry contract are the normalizer's own (``collector/decoding/normalize.py``). An engine
whose telemetry arrives in its own dialect (vLLM's ``llm_request`` and loading spans) ships a
translation beside its shim: a module whose ``BUILDERS`` maps its span names to row builders,
called as ``builder(scope, span, attributes, ids)`` like the normalizer's own (``scope`` is
``normalize.Scope``: ``batch.rows`` to append to, ``instance_id``, ``service_name``, ``engine``,
``model``). A new engine adds its module here; no collector file changes (STYLE §20, §23: the
OpenTelemetry Collector keeps each format's translation with its receiver).

Modules load on the first span the contract does not name, so importing the collector loads no
engine code until a foreign span arrives, and a translation may import the normalizer freely.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache

#: Engine -> module defining ``BUILDERS`` ({span name: builder}).
TRANSLATIONS: dict[str, str] = {
    "vllm": "tokentrace.engine_shim.vllm.translate",
}


@cache
def builders() -> dict[str, Callable]:
    """Every registered span name with its builder; two engines claiming one name is an error."""
    merged: dict[str, Callable] = {}
    owner: dict[str, str] = {}
    for engine, module in TRANSLATIONS.items():
        for name, builder in importlib.import_module(module).BUILDERS.items():
            if name in merged:
                raise ValueError(f"span name {name!r} is translated by both {owner[name]} and {engine}")
            merged[name], owner[name] = builder, engine
    return merged


def builder(span_name: str) -> Callable | None:
    """The builder registered for ``span_name``, or None (the span stays in ``spans`` only)."""
    return builders().get(span_name)
