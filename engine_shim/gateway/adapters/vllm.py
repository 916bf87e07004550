"""vLLM's OpenAI server (``vllm serve``), with or without the tokentrace plugin.

Without the plugin the gateway observes it from outside, with vLLM's help: ``POST /tokenize`` renders
and tokenizes chat messages with the served model's own template and tokenizer (so the gateway's
block fingerprints are the ones the plugin computes from ``BlockStored`` token ids), ``/metrics``
gives running/waiting requests and KV-cache usage, and ``usage.prompt_tokens_details.cached_tokens``
appears when vLLM runs with ``--enable-prompt-tokens-details``.

With the plugin (``VllmPluginAdapter``; ``--adapter NAME=vllm-plugin``, or detected by the
``tokentrace_plugin_info{instance="..."}`` line the plugin adds to ``/metrics``) vLLM reports every
request itself: the gateway emits no request row, only its hop, joined on the ``X-Request-Id`` it
forwards (vLLM builds its request id from that header; ``tokentrace.engine_shim.vllm.names.client_request_id``).
A plugin that watches vLLM's prompts (``prompts="1"`` on that line) sends each request's lookup
(fingerprint and segments from the token ids vLLM ran) and what the cache then holds itself; for
one that cannot (a vLLM whose frontend it does not know), the gateway still sends them (fingerprint
from ``/tokenize``, segments) under the plugin's instance id (the metric's label), where the
plugin's block evictions are.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import httpx

from tokentrace.engine_shim.gateway.adapters.base import (
    OBSERVER_PLUGIN,
    REPEATABLE_POST,
    Adapter,
    InstanceState,
    Probe,
    Route,
)
from tokentrace.engine_shim.gateway.adapters.openai import get_json

#: A metric line the tokentrace vLLM plugin exposes on vLLM's /metrics (detection only).
PLUGIN_METRIC = "tokentrace_plugin_info"
_PLUGIN_INSTANCE = re.compile(PLUGIN_METRIC + r'\{[^}]*instance="([^"]*)"')
_PLUGIN_PROMPTS = re.compile(PLUGIN_METRIC + r'\{[^}]*prompts="1"')
#: vLLM's cache configuration gauge; its block_size label is the prefix cache's granularity.
_BLOCK_SIZE = re.compile(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"')
_GAUGE = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$", re.MULTILINE)


class VllmAdapter(Adapter):
    """vLLM without the plugin."""

    kind: ClassVar[str] = "vllm"
    engine: ClassVar[str] = "vllm"
    measures: ClassVar[frozenset[str]] = frozenset({
        "prompt_tokens", "completion_tokens", "cached_tokens", "tokenize", "queue_state", "cache_state",
    })

    @classmethod
    async def probe(cls, client: httpx.AsyncClient, base_url: str) -> Probe | None:
        """``/version`` answers ``{"version": ...}`` and ``/metrics`` has ``vllm:`` series."""
        probe = await _probe_vllm(client, base_url)
        if probe is None or (probe[1] is not None) != (cls is VllmPluginAdapter):
            return None
        return cls._probe(*probe)

    @classmethod
    def _probe(cls, version: str | None, instance: str | None, block: int, prompts: bool) -> Probe:
        return Probe(kind=cls.kind, version=version, cache_block_tokens=block)

    async def tokenize(self, route: Route, body: dict[str, Any],
                       messages: list[dict[str, Any]] | None = None,
                       add_generation_prompt: bool = True) -> list[int] | None:
        """``POST /tokenize`` with the messages (chat template applied by vLLM) or the prompt."""
        request: dict[str, Any] = {"model": body.get("model")} if body.get("model") else {}
        if messages is not None:
            request.update(messages=messages, add_generation_prompt=add_generation_prompt,
                           continue_final_message=False)
            for key in ("chat_template", "chat_template_kwargs", "tools"):
                if key in body:
                    request[key] = body[key]
        else:
            prompt = body.get(route.prompt_field)
            if not isinstance(prompt, str):
                return None
            request["prompt"] = prompt
        try:
            response = await self.client.post(self.base_url + "/tokenize", json=request, extensions=REPEATABLE_POST)
            tokens = response.json().get("tokens") if response.is_success else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return [int(t) for t in tokens] if isinstance(tokens, list) else None

    async def poll(self) -> InstanceState:
        """``/health`` for readiness, ``/metrics`` for running/waiting and KV-cache usage (ratio)."""
        try:
            health = await self.client.get(self.base_url + "/health")
            metrics = await self.client.get(self.base_url + "/metrics")
        except httpx.HTTPError:
            return InstanceState(reachable=False)
        values = parse_gauges(metrics.text) if metrics.is_success else {}
        usage = values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc"))
        return InstanceState(
            reachable=True, ready=health.status_code == 200,
            running=_count(values.get("vllm:num_requests_running")),
            waiting=_count(values.get("vllm:num_requests_waiting")),
            cache_used=usage, cache_capacity=1.0 if usage is not None else None,
            cache_unit="ratio" if usage is not None else None,
        )


class VllmPluginAdapter(VllmAdapter):
    """vLLM with the tokentrace plugin: reports each request itself."""

    kind: ClassVar[str] = "vllm-plugin"

    @classmethod
    def forced_probe(cls) -> Probe:
        """The plugin reports itself (its instance id unknown until a probe reads /metrics)."""
        return Probe(kind=cls.kind, reports_itself=True, observer=OBSERVER_PLUGIN)

    @classmethod
    def _probe(cls, version: str | None, instance: str | None, block: int, prompts: bool) -> Probe:
        return Probe(kind=cls.kind, version=version, reports_itself=True, observer=OBSERVER_PLUGIN,
                     instance_id=instance or None, cache_block_tokens=block,
                     details={"fingerprint": True} if prompts else {})


async def _probe_vllm(client: httpx.AsyncClient, base_url: str) -> tuple[str | None, str | None, int, bool] | None:
    """(version, the plugin's instance id or None without the plugin, KV block size, whether the
    plugin sends prompt fingerprints) when ``base_url`` is vLLM."""
    base = base_url.rstrip("/")
    version = await get_json(client, base + "/version")
    if not isinstance(version, dict) or "version" not in version:
        return None
    try:
        metrics = await client.get(base + "/metrics")
    except httpx.HTTPError:
        return None
    if not metrics.is_success or "vllm:" not in metrics.text:
        return None
    found = _PLUGIN_INSTANCE.search(metrics.text)
    block = _BLOCK_SIZE.search(metrics.text)
    return (str(version["version"]), (found.group(1) if found else None), int(block.group(1)) if block else 1,
            _PLUGIN_PROMPTS.search(metrics.text) is not None)


def parse_gauges(text: str) -> dict[str, float]:
    """Sum of each ``vllm:`` series over its label sets, from Prometheus text format."""
    values: dict[str, float] = {}
    for name, _labels, value in _GAUGE.findall(text):
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


def _count(value: float | None) -> int | None:
    return None if value is None else int(value)
