"""SGLang's server (``python -m sglang.launch_server``). Tested against recorded documents, not a live
SGLang: it does not run on this CPU-only machine. Shapes from sgl-project/sglang
``python/sglang/srt/metrics/collector.py`` (``SchedulerMetricsCollector``: ``sglang:num_running_reqs``,
``sglang:num_queue_reqs``, ``sglang:num_used_tokens``, ``sglang:max_total_num_tokens``,
``sglang:token_usage``, ``sglang:cache_hit_rate``) and ``entrypoints/http_server.py``
(``/get_server_info``: the server arguments plus ``version``; ``/health``).

Per request it reports ``usage.prompt_tokens_details.cached_tokens`` (its radix cache) when started
with ``--enable-cache-report``; the base adapter reads it. About itself: running and queued requests,
and the KV pool in tokens (used of total) from ``/metrics`` with ``--enable-metrics``.
"""

from __future__ import annotations

from typing import ClassVar

import httpx

from tokentrace.engine_shim.gateway.adapters.base import Adapter, InstanceState, Probe
from tokentrace.engine_shim.gateway.adapters.openai import get_json
from tokentrace.engine_shim.gateway.adapters.prometheus import parse_samples


class SglangAdapter(Adapter):
    """SGLang."""

    kind: ClassVar[str] = "sglang"
    engine: ClassVar[str] = "sglang"
    measures: ClassVar[frozenset[str]] = frozenset({
        "prompt_tokens", "completion_tokens", "cached_tokens", "queue_state", "cache_state",
    })

    @classmethod
    async def probe(cls, client: httpx.AsyncClient, base_url: str) -> Probe | None:
        """``/get_server_info`` answers with SGLang's server arguments (``model_path``, ``version``)."""
        info = await get_json(client, base_url.rstrip("/") + "/get_server_info")
        if not isinstance(info, dict) or "model_path" not in info:
            return None
        return Probe(kind=cls.kind, version=str(info["version"]) if info.get("version") else None,
                     models=(str(info.get("served_model_name") or info["model_path"]),),
                     details={"enable_cache_report": bool(info.get("enable_cache_report"))})

    async def poll(self) -> InstanceState:
        """``/health`` for readiness; ``/metrics`` for queue and KV pool (tokens)."""
        try:
            health = await self.client.get(self.base_url + "/health")
            metrics = await self.client.get(self.base_url + "/metrics")
        except httpx.HTTPError:
            return InstanceState(reachable=False)
        values = parse_samples(metrics.text, "sglang:") if metrics.is_success else {}
        used, total = values.get("sglang:num_used_tokens"), values.get("sglang:max_total_num_tokens")
        running, queued = values.get("sglang:num_running_reqs"), values.get("sglang:num_queue_reqs")
        return InstanceState(
            reachable=True, ready=health.status_code == 200,
            running=None if running is None else int(running), waiting=None if queued is None else int(queued),
            cache_used=used, cache_capacity=total, cache_unit="tokens" if total is not None else None,
        )
