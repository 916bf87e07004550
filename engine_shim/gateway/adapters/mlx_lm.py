"""mlx-lm's own server (``python -m mlx_lm.server``, mlx-lm 0.32).

What it reports: ``usage`` with ``prompt_tokens_details.cached_tokens`` (its LRU prompt cache), in
streams only when asked (``stream_options.include_usage``; the base adapter asks). No tokenize
endpoint, no timings, no metrics: the gateway fingerprints with ``--tokenizer DIR`` or bytes.
``/v1/models`` lists the Hugging Face cache and fails when there is none, so the probe uses
``/health`` (``{"status": "ok"|"unavailable"}``) served by Python's ``http.server`` (``Server:
BaseHTTP/...``), which no other engine here uses.
"""

from __future__ import annotations

from typing import ClassVar

import httpx

from tokentrace.engine_shim.gateway.adapters.base import Adapter, InstanceState, Probe


class MlxLmAdapter(Adapter):
    """``mlx_lm.server``."""

    kind: ClassVar[str] = "mlx_lm"
    engine: ClassVar[str] = "mlx_lm.server"
    measures: ClassVar[frozenset[str]] = frozenset({"prompt_tokens", "completion_tokens", "cached_tokens"})

    @classmethod
    async def probe(cls, client: httpx.AsyncClient, base_url: str) -> Probe | None:
        """``/health`` answers ``{"status": ...}`` from ``BaseHTTP``."""
        try:
            response = await client.get(base_url.rstrip("/") + "/health")
        except httpx.HTTPError:
            return None
        if not response.headers.get("server", "").startswith("BaseHTTP"):
            return None
        try:
            body = response.json()
        except ValueError:
            return None
        if not isinstance(body, dict) or body.get("status") not in ("ok", "unavailable"):
            return None
        return Probe(kind=cls.kind)

    async def poll(self) -> InstanceState:
        """``/health``: 200 ready, 503 not yet."""
        try:
            response = await self.client.get(self.base_url + "/health")
        except httpx.HTTPError:
            return InstanceState(reachable=False)
        return InstanceState(reachable=True, ready=response.status_code == 200)
