"""LM Studio's server (default port 1234). Tested against recorded documents, not a live LM Studio
(a desktop application with no package here). Shapes from LM Studio's REST API v0 documentation
(lmstudio-ai/docs ``1_developer/2_rest/endpoints.mdx``, LM Studio 0.3.6+): ``GET /api/v0/models``
lists every downloaded model with ``state`` ``loaded`` | ``not-loaded``; ``POST
/api/v0/chat/completions`` and ``/api/v0/completions`` answer the OpenAI shape plus ``stats``
(``time_to_first_token`` and ``generation_time`` in seconds, ``tokens_per_second``, ``stop_reason``)
and ``model_info`` (``context_length``).

A request for a model the latest poll saw ``not-loaded`` made LM Studio load it just in time: the
cold-start reason names that.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import httpx

from tokentrace.engine_shim.gateway.adapters.base import (
    Adapter,
    Facts,
    InstanceState,
    LifecycleEvent,
    Probe,
    Route,
)
from tokentrace.engine_shim.gateway.adapters.openai import get_json

PREFIX = "lmstudio."
API_CHAT = Route("/api/v0/chat/completions", "chat")
API_COMPLETIONS = Route("/api/v0/completions", "completion")


def parse_models(document: Any) -> dict[str, str]:
    """``GET /api/v0/models`` as {model id: state}."""
    data = document.get("data") if isinstance(document, dict) else None
    return {str(m["id"]): str(m.get("state")) for m in data or () if isinstance(m, dict) and "id" in m}


def stats_facts(facts: Facts, payload: dict[str, Any]) -> None:
    """Fill ``facts`` from ``stats`` (seconds) and ``model_info``."""
    stats = payload.get("stats")
    if not isinstance(stats, dict):
        return
    for key, attr in (("time_to_first_token", "prefill_ms"), ("generation_time", "decode_ms")):
        value = stats.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            setattr(facts, attr, value * 1e3)
            facts.evidence[f"{PREFIX}stats.{key}_s"] = value
    for key in ("tokens_per_second", "stop_reason"):
        if isinstance(stats.get(key), (int, float, str)):
            facts.evidence[f"{PREFIX}stats.{key}"] = stats[key]
    info = payload.get("model_info")
    if isinstance(info, dict) and isinstance(info.get("context_length"), int):
        facts.evidence[f"{PREFIX}model_info.context_length"] = info["context_length"]
    if isinstance(payload.get("model"), str):
        facts.evidence[f"{PREFIX}model"] = payload["model"]


class LmStudioAdapter(Adapter):
    """LM Studio."""

    kind: ClassVar[str] = "lmstudio"
    engine: ClassVar[str] = "lmstudio"
    measures: ClassVar[frozenset[str]] = frozenset({"prompt_tokens", "completion_tokens", "prefill", "decode",
                                                    "lifecycle"})
    extra_routes: ClassVar[tuple[Route, ...]] = (API_CHAT, API_COMPLETIONS)

    def __init__(self, name: str, base_url: str, client: httpx.AsyncClient, probe: Probe):
        super().__init__(name, base_url, client, probe)
        self.states: dict[str, str] = {}  #: model -> state at the latest poll

    @classmethod
    async def probe(cls, client: httpx.AsyncClient, base_url: str) -> Probe | None:
        """``/api/v0/models`` lists models with a ``state``."""
        models = parse_models(await get_json(client, base_url.rstrip("/") + "/api/v0/models"))
        if not models or not set(models.values()) <= {"loaded", "not-loaded"}:
            return None
        return Probe(kind=cls.kind, models=tuple(models))

    def facts_from_payload(self, facts: Facts, payload: Any, route: Route) -> None:
        """OpenAI shapes through the base, then ``stats`` (the v0 routes)."""
        super().facts_from_payload(facts, payload, route)
        if isinstance(payload, dict):
            stats_facts(facts, payload)

    def finish(self, facts: Facts) -> None:
        """A request for a model the latest poll saw not loaded paid a just-in-time load."""
        model = facts.evidence.get(f"{PREFIX}model")
        if isinstance(model, str) and self.states.get(model) == "not-loaded":
            facts.evidence[f"{PREFIX}cold_start"] = (
                f"model {model} was not loaded at the last poll of /api/v0/models: LM Studio loaded it just "
                f"in time for this request (its time_to_first_token includes the load)")

    async def poll(self) -> InstanceState:
        """``/api/v0/models``: which models are loaded; changes are lifecycle events."""
        document = await get_json(self.client, self.base_url + "/api/v0/models")
        if document is None:
            return InstanceState(reachable=False)
        now, states = time.time_ns(), parse_models(document)
        events = tuple(LifecycleEvent(f"model.{'loaded' if state == 'loaded' else 'unloaded'}", now,
                                      f"model {model} {state}")
                       for model, state in states.items() if self.states.get(model, state) != state)
        self.states = states
        loaded = tuple(m for m, s in states.items() if s == "loaded")
        return InstanceState(reachable=True, ready=True, models=loaded, events=events)
