"""Evidence from what an upstream engine reported about a request in its own fields, as the
gateway's adapter read them (``requests.upstream_evidence``; docs/gateway.md, "Engine adapters"):
llama.cpp's ``timings`` and slot, Ollama's durations, LM Studio's stats — measured by the engine —
and the reasons the adapter derived from the engine's state (a keep-alive expiry, a runner still
loading, a slot that outgrew its context) — inferred. The vLLM plugin records a preemption on its
own row the same way (``vllm.preemptions``, ``vllm.reprocess_reason``; docs/vllm.md), and where a
request's queue began before vLLM's engine core took it in (``vllm.intake_ms``, ``vllm.queue_reason``)."""

from __future__ import annotations

import json
from typing import Any

from tokentrace.analyzers.evidence import Evidence

#: Key suffixes of reasons an adapter derived, per verdict: a cold start's cause and where a queue
#: was spent for the slowness verdict, a re-processed prompt's cause for the cache verdict.
REASONS = {"slow": (".cold_start", ".queue_reason"), "cache": (".reprocess_reason",)}


def upstream_evidence(request: dict, verdict: str) -> list[Evidence]:
    """The ``engine_reported`` numbers and the ``engine_reason`` items of ``verdict`` ("slow" or
    "cache") for one requests row; none when the row has no upstream evidence."""
    raw = request.get("upstream_evidence")
    try:
        facts: dict[str, Any] = json.loads(raw) if raw else {}
    except ValueError:
        return []
    if not isinstance(facts, dict) or not facts:
        return []
    reasons = {k: v for k, v in facts.items() if k.endswith(REASONS[verdict]) and isinstance(v, str)}
    numbers = {k: v for k, v in facts.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    found = []
    if numbers:
        listed = ", ".join(f"{k} = {v}" for k, v in sorted(numbers.items()))
        found.append(Evidence("engine_reported", f"The engine ({request.get('engine')}) reported {listed}.",
                              {"engine": request.get("engine"), "facts": numbers}))
    for key, text in sorted(reasons.items()):
        data: dict[str, Any] = {"source": key}
        cluster_instance = facts.get(key.split(".", 1)[0] + ".instance_id")
        if isinstance(cluster_instance, str):
            # A cluster engine's instance (Exo) is shown on the instances page, anchored by its id.
            data.update(instance_id=cluster_instance, link=f"/instances#exo-{cluster_instance}",
                        link_text=f"instance {cluster_instance} on the instances page")
        found.append(Evidence("engine_reason", text[:1].upper() + text[1:] + ".", data, basis="inferred"))
    return found
