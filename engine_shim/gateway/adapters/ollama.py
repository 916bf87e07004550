"""Ollama (tested against recorded documents, not a live Ollama: none installs here; shapes from
docs.ollama.com/api — chat, generate, ps — and ollama/ollama ``api/types.go``: ``ChatResponse``,
``GenerateResponse``, ``Metrics``, ``ProcessModelResponse``).

Native ``/api/chat`` and ``/api/generate`` stream NDJSON and end with a document carrying the
request's ``Metrics`` in nanoseconds: ``load_duration`` (the model load this request paid: a cold
start), ``prompt_eval_count`` / ``prompt_eval_duration`` (prefill), ``eval_count`` /
``eval_duration`` (decode). The OpenAI routes under ``/v1`` carry only ``usage``.

``/api/ps`` lists the loaded models with ``expires_at`` (keep-alive, 5 minutes by default). A model
missing from ``/api/ps`` that an earlier poll showed, once its ``expires_at`` passed, was unloaded
because its keep-alive expired; the next request that pays ``load_duration`` gets that as the
reason for its cold start, with the expiry time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

import httpx

from tokentrace.engine_shim.gateway.adapters.base import (
    FRAMING_NDJSON,
    Adapter,
    Facts,
    InstanceState,
    LifecycleEvent,
    Probe,
    Route,
)
from tokentrace.engine_shim.gateway.adapters.openai import get_json

PREFIX = "ollama."
_NS_PER_MS = 1e6

#: Ollama's native routes: NDJSON streams, streaming unless ``"stream": false``.
API_CHAT = Route("/api/chat", "chat", stream_framing=FRAMING_NDJSON, stream_default=True)
API_GENERATE = Route("/api/generate", "completion", stream_framing=FRAMING_NDJSON, stream_default=True)


@dataclass(frozen=True)
class LoadedModel:
    """One model of ``/api/ps``."""

    name: str  #: ``model`` (or ``name``)
    size: int | None  #: bytes in memory
    size_vram: int | None  #: of those, in GPU memory
    expires_at: datetime | None  #: when keep-alive unloads it


@dataclass(frozen=True)
class Unload:
    """A model that left ``/api/ps`` between two polls."""

    model: str
    seen_until_ns: int  #: the last poll that listed it
    gone_at_ns: int  #: the first poll that did not
    expires_at: datetime | None  #: its keep-alive expiry as last listed

    @property
    def keep_alive_expired(self) -> bool:
        """Its expiry had passed when the poll found it gone (else: stopped, evicted for another model)."""
        return self.expires_at is not None and self.expires_at.timestamp() * 1e9 <= self.gone_at_ns

    def reason(self) -> str:
        """Human text for the cold-start evidence."""
        if self.keep_alive_expired:
            return (f"model {self.model} was unloaded when its keep-alive expired at "
                    f"{self.expires_at.isoformat()} (listed by /api/ps until then), so this request paid the load")
        return (f"model {self.model} was unloaded before its keep-alive expired (stopped, or evicted for "
                f"another model), so this request paid the load")


def parse_ps(document: Any) -> dict[str, LoadedModel]:
    """``GET /api/ps`` as {model: LoadedModel}."""
    models = document.get("models") if isinstance(document, dict) else None
    loaded: dict[str, LoadedModel] = {}
    for item in models if isinstance(models, list) else ():
        if not isinstance(item, dict):
            continue
        name = item.get("model") or item.get("name")
        if not isinstance(name, str):
            continue
        loaded[name] = LoadedModel(name, _int(item.get("size")), _int(item.get("size_vram")),
                                   _time(item.get("expires_at")))
    return loaded


def metrics_facts(facts: Facts, payload: dict[str, Any]) -> None:
    """Fill ``facts`` from the final document's ``Metrics`` (nanoseconds)."""
    for key, attr in (("load_duration", "load_ms"), ("prompt_eval_duration", "prefill_ms"),
                      ("eval_duration", "decode_ms")):
        value = _int(payload.get(key))
        if value is not None:
            setattr(facts, attr, value / _NS_PER_MS)
            facts.evidence[f"{PREFIX}{key}_ns"] = value
    prompt, output = _int(payload.get("prompt_eval_count")), _int(payload.get("eval_count"))
    if prompt is not None:
        facts.prompt_tokens = prompt
        facts.evidence[f"{PREFIX}prompt_eval_count"] = prompt
    if output is not None:
        facts.completion_tokens = output
        facts.evidence[f"{PREFIX}eval_count"] = output
    if payload.get("done") and isinstance(payload.get("done_reason"), str):
        facts.finish_reasons = [payload["done_reason"]]


class OllamaAdapter(Adapter):
    """Ollama's server (default port 11434)."""

    kind: ClassVar[str] = "ollama"
    engine: ClassVar[str] = "ollama"
    measures: ClassVar[frozenset[str]] = frozenset({
        "prompt_tokens", "completion_tokens", "load_wait", "prefill", "decode", "lifecycle",
    })
    extra_routes: ClassVar[tuple[Route, ...]] = (API_CHAT, API_GENERATE)

    #: A load shorter than this is a warm model's bookkeeping, not a cold start (Ollama reports a few
    #: milliseconds of load_duration on every request).
    COLD_LOAD_MS: ClassVar[float] = 100.0

    def __init__(self, name: str, base_url: str, client: httpx.AsyncClient, probe: Probe):
        super().__init__(name, base_url, client, probe)
        self.loaded: dict[str, LoadedModel] = {}  #: /api/ps at the latest poll
        self.last_poll_ns: int | None = None
        self.unloads: dict[str, Unload] = {}  #: latest unload per model, until a request paid for it

    @classmethod
    async def probe(cls, client: httpx.AsyncClient, base_url: str) -> Probe | None:
        """``/api/version`` answers ``{"version": ...}`` and ``/api/ps`` answers ``{"models": [...]}``."""
        base = base_url.rstrip("/")
        version = await get_json(client, base + "/api/version")
        if not isinstance(version, dict) or "version" not in version:
            return None
        ps = await get_json(client, base + "/api/ps")
        if not isinstance(ps, dict) or not isinstance(ps.get("models"), list):
            return None
        return Probe(kind=cls.kind, version=str(version["version"]), models=tuple(parse_ps(ps)))

    def facts_from_payload(self, facts: Facts, payload: Any, route: Route) -> None:
        """OpenAI shapes (``/v1``) through the base; native documents through their ``Metrics``."""
        super().facts_from_payload(facts, payload, route)
        if isinstance(payload, dict) and route.path in (API_CHAT.path, API_GENERATE.path):
            metrics_facts(facts, payload)
            if isinstance(payload.get("model"), str):
                facts.evidence[f"{PREFIX}model"] = payload["model"]
            if isinstance(payload.get("error"), str):
                facts.error = payload["error"][:200]

    def finish(self, facts: Facts) -> None:
        """A request that paid a load after its model's unload gets the unload as its reason."""
        if facts.load_ms is None or facts.load_ms < self.COLD_LOAD_MS or not self.unloads:
            return
        model = facts.evidence.get(f"{PREFIX}model")
        unload = self.unloads.pop(model, None) if isinstance(model, str) else None
        if unload is None and len(self.unloads) == 1:
            unload = self.unloads.popitem()[1]
        if unload is not None:
            facts.evidence[f"{PREFIX}cold_start"] = unload.reason()
            if unload.expires_at is not None:
                facts.evidence[f"{PREFIX}keep_alive_expired_at"] = unload.expires_at.isoformat()

    def prepare(self, route: Route, body: dict[str, Any], streamed: bool) -> dict[str, Any]:
        """Native routes go as sent; OpenAI routes get the base's usage request."""
        if route.path in (API_CHAT.path, API_GENERATE.path):
            return body
        return super().prepare(route, body, streamed)

    async def poll(self) -> InstanceState:
        """``/api/ps``: loaded models; a model gone since the last poll is an unload event."""
        ps = await get_json(self.client, self.base_url + "/api/ps")
        now = time.time_ns()
        if ps is None:
            return InstanceState(reachable=await self._reachable())
        loaded = parse_ps(ps)
        events = []
        for name, before in self.loaded.items():
            if name not in loaded and self.last_poll_ns is not None:
                unload = Unload(name, self.last_poll_ns, now, before.expires_at)
                self.unloads[name] = unload
                events.append(LifecycleEvent("model.unloaded", now, unload.reason().split(", so")[0]))
        for name in loaded.keys() - self.loaded.keys():
            events.append(LifecycleEvent("model.loaded", now, f"model {name} loaded"))
        self.loaded, self.last_poll_ns = loaded, now
        return InstanceState(reachable=True, ready=True, loading=None, models=tuple(loaded),
                             events=tuple(events))

    async def _reachable(self) -> bool:
        try:
            await self.client.get(self.base_url + "/")
        except httpx.HTTPError:
            return False
        return True


def _time(value: Any) -> datetime | None:
    """An RFC 3339 time as Go writes it (nanosecond fractions are cut to microseconds)."""
    if not isinstance(value, str):
        return None
    text = value.replace("Z", "+00:00")
    head, dot, rest = text.partition(".")
    if dot:
        digits = rest[: len(rest) - len(rest.lstrip("0123456789"))]
        zone = rest[len(digits):]
        text = f"{head}.{digits[:6].ljust(6, '0')}{zone}"
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
