"""A tokentrace engine (``tokentrace engine``) as an upstream: it reports every phase itself.

The gateway adds only its own hop (routing decision, gateway wait) to the request's trace; the
engine's ``llm.request`` row is the request's row, joined with the hop on the request id the gateway
forwards as ``X-Request-Id``. Detected by ``/v1/models`` entries ``owned_by: "tokentrace"``.
"""

from __future__ import annotations

from typing import ClassVar

import httpx

from tokentrace.engine_shim.gateway.adapters.base import OBSERVER_ENGINE, Adapter, Probe
from tokentrace.engine_shim.gateway.adapters.openai import get_json, model_ids

#: ``owned_by`` of the tokentrace engine's /v1/models entries.
OWNED_BY = "tokentrace"


class TokentraceEngineAdapter(Adapter):
    """``tokentrace engine``: reports itself."""

    kind: ClassVar[str] = "tokentrace"
    engine: ClassVar[str] = "mlx-lm"
    measures: ClassVar[frozenset[str]] = frozenset({
        "prompt_tokens", "completion_tokens", "cached_tokens", "queue", "load_wait", "prefill", "decode",
        "fingerprint",
    })

    @classmethod
    async def probe(cls, client: httpx.AsyncClient, base_url: str) -> Probe | None:
        """``/v1/models`` with ``owned_by: "tokentrace"``."""
        models = await get_json(client, base_url.rstrip("/") + "/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if not data or not all(isinstance(m, dict) and m.get("owned_by") == OWNED_BY for m in data):
            return None
        return Probe(kind=cls.kind, models=model_ids(models), reports_itself=True, observer=OBSERVER_ENGINE)

    @classmethod
    def forced_probe(cls) -> Probe:
        """A tokentrace engine reports itself."""
        return Probe(kind=cls.kind, reports_itself=True, observer=OBSERVER_ENGINE)
