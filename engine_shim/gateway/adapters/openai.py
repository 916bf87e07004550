"""The generic OpenAI-compatible adapter: the fallback for any engine that answers ``/v1/models``.

It knows only the OpenAI response shape (the base class): usage tokens, cached tokens when the
engine fills ``prompt_tokens_details``, finish reasons. No tokenizer, no engine timings.
"""

from __future__ import annotations

from typing import ClassVar

import httpx

from tokentrace.engine_shim.gateway.adapters.base import Adapter, Probe


class OpenAIAdapter(Adapter):
    """Any engine with OpenAI's ``/v1/models`` and ``/v1/chat/completions``."""

    kind: ClassVar[str] = "openai"
    engine: ClassVar[str] = "openai-compatible"
    measures: ClassVar[frozenset[str]] = frozenset({"prompt_tokens", "completion_tokens", "cached_tokens"})

    @classmethod
    async def probe(cls, client: httpx.AsyncClient, base_url: str) -> Probe | None:
        """Accepts anything whose ``/v1/models`` answers 2xx with JSON (the last resort)."""
        models = await get_json(client, base_url.rstrip("/") + "/v1/models")
        if models is None:
            return None
        return Probe(kind=cls.kind, models=model_ids(models))


async def get_json(client: httpx.AsyncClient, url: str) -> object | None:
    """The JSON body of a 2xx GET, or None (unreachable, non-2xx, not JSON)."""
    try:
        response = await client.get(url)
    except httpx.HTTPError:
        return None
    if not response.is_success:
        return None
    try:
        return response.json()
    except ValueError:
        return None


def model_ids(models: object) -> tuple[str, ...]:
    """Model ids of an OpenAI ``/v1/models`` body (``{"data": [{"id": ...}]}``)."""
    data = models.get("data") if isinstance(models, dict) else None
    return tuple(str(m["id"]) for m in data or () if isinstance(m, dict) and "id" in m)
