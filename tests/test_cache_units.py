"""The cache capacity unit (tokentrace.cache.unit): both shims say what an entry is, the collector
stores it, and the cache page never adds an MLX prompt entry to a vLLM KV block.

Before the unit, ``tokentrace.cache.entries`` meant prompt entries for MLX and KV blocks for vLLM,
and the cache page summed them into one "entries" figure and let free vLLM blocks bound the
sessions that fit (one block holds 16 tokens, not a session)."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import httpx
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tokentrace import contract as c
from tokentrace.engine_shim.emit import encode
from tokentrace.engine_shim.emit.spool import SpoolingSpanExporter
from tokentrace.engine_shim.mlx.records import Clock, HeartbeatRecord
from tokentrace.engine_shim.mlx.spans import SpanBuilder
from tokentrace.engine_shim.vllm.steps import heartbeat_record


def test_encoders_leave_unknown_values_out_and_refuse_unknown_units_and_reasons():
    beat = encode.heartbeat(unit=c.UNIT_BLOCK, queue_depth=2, running=None, cache_entries=None,
                            cache_max_entries=100)
    assert beat == {c.QUEUE_DEPTH: 2, c.CACHE_UNIT: "block", c.CACHE_MAX_ENTRIES: 100}
    with pytest.raises(ValueError, match="cache unit must be one of"):
        encode.cache_state("blocks", 1, None)
    with pytest.raises(ValueError, match="eviction reason must be one of"):
        encode.eviction(unit=c.UNIT_ENTRY, tokens=3, reason="full")
    start, end, attrs = encode.steps_window([100, 300], [150, 50], [1, 0], [0, 2], [30, 0], [0, 2],
                                            ["a", "a", "b"])
    assert (start, end) == (100, 350)
    assert attrs[c.STEPS_REQUESTS] == ["a", "b"] and attrs[c.STEPS_MEMBERS] == [0, 0, 1]
    assert c.STEPS_REQUESTS not in encode.steps_window([5], [1], [0], [1], [0], [1])[2]


def _mlx_heartbeat_span(at_ns: int):
    """The MLX engine's heartbeat, built by its own SpanBuilder on the real SDK."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({
        c.SERVICE_NAME: "tokentrace-engine", c.SERVICE_INSTANCE_ID: "mlx-1", c.ENGINE: c.ENGINE_MLX}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    builder = SpanBuilder(provider.get_tracer("test"), Clock(offset_ns=0))
    builder.heartbeat(HeartbeatRecord(
        at_ns=at_ns, queue_depth=0, running=1, max_batch=8, cache_entries=3, cache_bytes=300_000,
        cache_max_entries=16, cache_max_bytes=1_000_000, kv_bytes_per_token=1000, memory_bytes=10**7))
    provider.shutdown()
    return exporter.get_finished_spans()


def _vllm_heartbeat_span(at_ns: int):
    """The vLLM plugin's heartbeat from SchedulerStats-shaped numbers, as the plugin exports it."""
    stats = SimpleNamespace(num_waiting_reqs=1, num_running_reqs=2, kv_cache_usage=0.25)
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4),
                             cache_config=SimpleNamespace(num_gpu_blocks=1000, block_size=16))
    record = heartbeat_record(at_ns, stats, config, bytes_per_token=1000, cached_blocks=500)
    resource = Resource({c.SERVICE_NAME: "vllm", c.SERVICE_INSTANCE_ID: "vllm-1", c.ENGINE: c.ENGINE_VLLM})
    return [record.to_readable(resource)]


def test_both_shims_send_their_unit_and_the_cache_page_keeps_units_apart(collector_factory):
    collector = collector_factory().start()
    now = time.time_ns() - 1_000_000_000
    mlx_spans, vllm_spans = _mlx_heartbeat_span(now), _vllm_heartbeat_span(now)
    assert mlx_spans[0].attributes[c.CACHE_UNIT] == c.UNIT_ENTRY
    assert vllm_spans[0].attributes[c.CACHE_UNIT] == c.UNIT_BLOCK
    exporter = SpoolingSpanExporter(collector.url, None, timeout=30)
    for spans in (mlx_spans, vllm_spans):
        assert exporter.export(spans).name == "SUCCESS"
    exporter.shutdown()

    data = httpx.get(collector.url + "/cache.json?since=1h", timeout=30).json()
    assert data["cluster"]["entries"] == [
        {"unit": "block", "entries": 500, "max_entries": 1000, "instances": 1},
        {"unit": "entry", "entries": 3, "max_entries": 16, "instances": 1},
    ]
    rows = {row["instance_id"]: row for row in data["instances"]}
    assert rows["vllm-1"]["unit"] == "block" and rows["mlx-1"]["unit"] == "entry"
    # No requests in the window: no average context, so bytes say nothing about sessions. The MLX
    # cache's free entries still bound them (13 of 16 free); vLLM's free blocks do not.
    assert (rows["mlx-1"]["more_sessions"], rows["mlx-1"]["sessions_in_all"]) == (13, 16)
    assert (rows["vllm-1"]["more_sessions"], rows["vllm-1"]["sessions_in_all"]) == (None, None)
    page = httpx.get(collector.url + "/cache?since=1h", timeout=30).text
    shown = dict(re.findall(r'data-metric="(cluster\.entries\.[a-z]+)" data-value="([^"]*)"', page))
    assert shown == {"cluster.entries.block": "500", "cluster.entries.entry": "3"}
    assert re.search(r'data-unit="block">500 / 1,000 <span class="sub">blocks</span>', page)

    collector.stop()
    assert collector.sql("SELECT instance_id, cache_unit, cache_entries, cache_max_entries FROM heartbeats "
                         "ORDER BY instance_id") == [("mlx-1", "entry", 3, 16), ("vllm-1", "block", 500, 1000)]
