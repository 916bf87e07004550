"""llama.cpp's ``llama-server`` (tested for real against the build ``tests/setup_llama.sh`` makes from
llama-cpp-python 0.3.36's vendored llama.cpp; shapes from ``tools/server/server-common.cpp``,
``server-context.cpp``, ``server-task.cpp``).

What it reports about each request: the response's ``timings`` (``cache_n`` prompt tokens reused from
the slot's cache, ``prompt_n`` tokens computed and ``prompt_ms``, ``predicted_n`` / ``predicted_ms``)
and ``id_slot``, the slot (one cached sequence each) that served it. About itself: ``/health`` (503
``Loading model`` while loading), ``/slots`` (per slot ``n_ctx``, ``is_processing``, the last task's
prompt tokens, processed and cached), ``/metrics`` with ``--metrics`` (``llamacpp:requests_processing``,
``llamacpp:requests_deferred``), ``/tokenize`` and ``/apply-template`` for exact prompt tokens.

llama.cpp's own explanation of a cache miss is a log line ("forcing full prompt re-processing ...");
``reprocess_reason`` gives the reason from what the slot held before and what the request needed:
the conversation outgrew the slot's context (llama.cpp shifted or dropped it), the slot held another
conversation, or the prompt changed before the cached part ended. What a slot held is the previous
request it served (its ``timings``, seen by this adapter in order) against the slot's ``n_ctx``
(``/props`` at probe time, ``/slots`` at each poll).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import httpx

from tokentrace.engine_shim.gateway.adapters.base import (
    REPEATABLE_POST,
    Adapter,
    Facts,
    InstanceState,
    Probe,
    Route,
)
from tokentrace.engine_shim.gateway.adapters.openai import get_json
from tokentrace.engine_shim.gateway.adapters.prometheus import parse_samples

#: Evidence keys this adapter fills (``Facts.evidence``), prefixed so the dashboard shows the source.
PREFIX = "llama.cpp."


@dataclass(frozen=True)
class SlotState:
    """One slot as ``/slots`` shows it after its last task."""

    id: int  #: slot id (``id_slot`` in responses)
    n_ctx: int | None  #: context size of the slot, tokens
    processing: bool  #: a task runs in it now
    prompt_tokens: int | None  #: tokens of its last task's prompt (what its cache holds, plus output)
    cached: int | None  #: of those, reused from the cache
    decoded: int | None  #: tokens its last task generated


def parse_slots(document: Any) -> dict[int, SlotState]:
    """``GET /slots`` as {slot id: SlotState}; an unexpected document gives {}."""
    slots: dict[int, SlotState] = {}
    for item in document if isinstance(document, list) else ():
        if not isinstance(item, dict) or not isinstance(item.get("id"), int):
            continue
        next_token = item.get("next_token")
        decoded = next_token[0].get("n_decoded") if isinstance(next_token, list) and next_token and \
            isinstance(next_token[0], dict) else None
        slots[item["id"]] = SlotState(
            id=item["id"], n_ctx=_int(item.get("n_ctx")), processing=bool(item.get("is_processing")),
            prompt_tokens=_int(item.get("n_prompt_tokens")), cached=_int(item.get("n_prompt_tokens_cache")),
            decoded=_int(decoded),
        )
    return slots


def timings_facts(facts: Facts, timings: dict[str, Any]) -> None:
    """Fill ``facts`` from a response's ``timings``: cached tokens, prefill and decode times."""
    cache_n, prompt_n = _int(timings.get("cache_n")), _int(timings.get("prompt_n"))
    predicted_n = _int(timings.get("predicted_n"))
    if cache_n is not None:
        facts.cached_tokens = cache_n
    if cache_n is not None and prompt_n is not None:
        facts.prompt_tokens = cache_n + prompt_n
    if predicted_n is not None:
        facts.completion_tokens = predicted_n
    prompt_ms, predicted_ms = _num(timings.get("prompt_ms")), _num(timings.get("predicted_ms"))
    if prompt_ms is not None:
        facts.prefill_ms = prompt_ms
    if predicted_ms is not None:
        facts.decode_ms = predicted_ms
    for key in ("cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms"):
        value = timings.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            facts.evidence[f"{PREFIX}timings.{key}"] = value


def reprocess_reason(cache_n: int, prompt_tokens: int, slot_before: SlotState | None,
                     shared_with_before: int | None) -> str | None:
    """Why llama.cpp computed prompt tokens it might have reused, from what the slot held before.

    ``shared_with_before``: how many leading tokens this prompt shares with the slot's previous
    prompt, when the gateway knows both (fingerprints); None when it does not. None as the answer:
    nothing was recomputed that the slot could have given (a full hit, or nothing to reuse).
    """
    if cache_n >= prompt_tokens - 1 or slot_before is None or slot_before.prompt_tokens is None:
        return None
    held = slot_before.prompt_tokens + (slot_before.decoded or 0)
    if slot_before.n_ctx is not None and held >= slot_before.n_ctx:
        return (f"the slot's context was full ({held} of {slot_before.n_ctx} tokens after its previous "
                f"request): llama.cpp discarded the cached sequence and re-processed the prompt")
    if shared_with_before is not None and shared_with_before < min(slot_before.prompt_tokens, prompt_tokens):
        if shared_with_before <= 1:
            return (f"slot {slot_before.id} held another conversation ({slot_before.prompt_tokens} prompt "
                    f"tokens sharing nothing with this one): its cache could not be reused")
        return (f"the prompt differs from what slot {slot_before.id} held after token {shared_with_before}: "
                f"llama.cpp reused {cache_n} tokens and re-processed the rest")
    return None


class LlamaCppAdapter(Adapter):
    """llama.cpp ``llama-server``."""

    kind: ClassVar[str] = "llama.cpp"
    engine: ClassVar[str] = "llama.cpp"
    measures: ClassVar[frozenset[str]] = frozenset({
        "prompt_tokens", "completion_tokens", "cached_tokens", "prefill", "decode", "slot", "tokenize",
        "queue_state", "cache_state", "lifecycle",
    })

    def __init__(self, name: str, base_url: str, client: httpx.AsyncClient, probe: Probe):
        super().__init__(name, base_url, client, probe)
        self.slots: dict[int, SlotState] = {}  #: slots at the latest poll
        self.loading = False  #: /health said "Loading model" at the latest poll
        self.n_ctx: int | None = _int(probe.details.get("n_ctx"))  #: tokens per slot (/props, /slots)
        self.n_slots: int | None = _int(probe.details.get("n_slots"))  #: slots of the server (/props)
        self.served: dict[int, SlotState] = {}  #: per slot, what its previous request left in it

    @classmethod
    async def probe(cls, client: httpx.AsyncClient, base_url: str) -> Probe | None:
        """``/v1/models`` lists models ``owned_by`` ``llamacpp``; ``/props`` gives the build."""
        base = base_url.rstrip("/")
        models = await get_json(client, base + "/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if not isinstance(data, list) or not any(isinstance(m, dict) and m.get("owned_by") == "llamacpp"
                                                 for m in data):
            return None
        props = await get_json(client, base + "/props")
        props = props if isinstance(props, dict) else {}
        settings = props.get("default_generation_settings")
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        version = props.get("build_info")
        return Probe(kind=cls.kind, version=str(version) if version else None,
                     models=tuple(str(m.get("id")) for m in data if isinstance(m, dict)),
                     details={"n_slots": props.get("total_slots"), "n_ctx": n_ctx})

    def prepare(self, route: Route, body: dict[str, Any], streamed: bool) -> dict[str, Any]:
        """The base's usage request; ``timings`` come with every llama-server answer."""
        return super().prepare(route, body, streamed)

    def facts_from_payload(self, facts: Facts, payload: Any, route: Route) -> None:
        """The OpenAI fields, then ``timings`` and ``id_slot`` (they override usage: exact)."""
        super().facts_from_payload(facts, payload, route)
        if not isinstance(payload, dict):
            return
        timings = payload.get("timings")
        if isinstance(timings, dict):
            timings_facts(facts, timings)
        slot = payload.get("id_slot")
        if isinstance(slot, int) and not isinstance(slot, bool):
            facts.slot = str(slot)
            facts.evidence[f"{PREFIX}id_slot"] = slot
        elif isinstance(timings, dict) and self.n_slots == 1:
            # The OpenAI routes name no slot (only /completion does); with one slot it is slot 0.
            facts.slot = "0"

    def finish(self, facts: Facts) -> None:
        """Name the reason when the slot that served the request had to re-process its prompt, and
        remember what the request left in its slot."""
        cache_n = facts.evidence.get(f"{PREFIX}timings.cache_n")
        if facts.slot is None or not isinstance(cache_n, int) or facts.prompt_tokens is None:
            return
        slot = int(facts.slot)
        polled = self.slots.get(slot)
        n_ctx = polled.n_ctx if polled is not None and polled.n_ctx is not None else self.n_ctx
        if n_ctx is not None:
            facts.evidence[f"{PREFIX}slot.n_ctx"] = n_ctx
        reason = reprocess_reason(cache_n, facts.prompt_tokens, self.served.get(slot), None)
        if reason is not None:
            facts.evidence[f"{PREFIX}reprocess_reason"] = reason
        self.served[slot] = SlotState(slot, n_ctx, False, facts.prompt_tokens, cache_n, facts.completion_tokens)

    async def tokenize(self, route: Route, body: dict[str, Any],
                       messages: list[dict[str, Any]] | None = None,
                       add_generation_prompt: bool = True) -> list[int] | None:
        """``/apply-template`` renders chat messages with the model's template, ``/tokenize`` (with
        special tokens parsed, as the server does for prompts) gives the ids."""
        if messages is not None:
            # llama.cpp renders a list that ends with an assistant message as that message's
            # continuation (no end marker): segment ends of assistant turns are a few tokens short.
            rendered = await self._post("/apply-template", {"messages": messages,
                                                            "add_generation_prompt": add_generation_prompt})
            text = rendered.get("prompt") if isinstance(rendered, dict) else None
            if not isinstance(text, str):
                return None
        else:
            text = body.get(route.prompt_field)
            if not isinstance(text, str):
                return None
        tokens = await self._post("/tokenize", {"content": text, "add_special": True, "parse_special": True})
        ids = tokens.get("tokens") if isinstance(tokens, dict) else None
        return [int(t) for t in ids] if isinstance(ids, list) else None

    async def poll(self) -> InstanceState:
        """``/health`` (503 while loading), ``/slots`` (per-slot cache), ``/metrics`` (queue)."""
        try:
            health = await self.client.get(self.base_url + "/health")
        except httpx.HTTPError:
            return InstanceState(reachable=False)
        self.loading = health.status_code == 503
        if health.status_code != 200:
            return InstanceState(reachable=True, ready=False, loading=self.loading)
        slots = parse_slots(await get_json(self.client, self.base_url + "/slots"))
        if slots:
            self.slots = slots
            self.n_ctx = next(iter(slots.values())).n_ctx or self.n_ctx
        metrics: dict[str, float] = {}
        try:
            response = await self.client.get(self.base_url + "/metrics")
            if response.is_success:
                metrics = parse_samples(response.text, "llamacpp:")
        except httpx.HTTPError:
            pass
        busy = sum(slot.processing for slot in slots.values()) if slots else None
        running = metrics.get("llamacpp:requests_processing", busy)
        waiting = metrics.get("llamacpp:requests_deferred")
        return InstanceState(
            reachable=True, ready=True, loading=False,
            running=None if running is None else int(running),
            waiting=None if waiting is None else int(waiting),
            cache_used=float(sum(1 for s in slots.values() if s.prompt_tokens)) if slots else None,
            cache_capacity=float(len(slots)) if slots else None,
            cache_unit="slot" if slots else None,
        )

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            response = await self.client.post(self.base_url + path, json=body, extensions=REPEATABLE_POST)
            return response.json() if response.is_success else None
        except (httpx.HTTPError, ValueError):
            return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
