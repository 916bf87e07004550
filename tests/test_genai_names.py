"""Issue 15: the collector reads the GenAI usage and latency names in both spellings (current, and
the legacy ones vLLM's llm_request still sends), and the MLX engine's request span carries the
GenAI attributes that have a convention (docs/telemetry.md, "OpenTelemetry GenAI conventions")."""

from __future__ import annotations

import os

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace import contract as c
from tokentrace.collector.decoding.normalize import TABLES, normalize

START = 1_700_000_000_000_000_000


def _payload(name: str, attributes: dict, engine: str | None) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource = {c.SERVICE_INSTANCE_ID: "inst-1", c.SERVICE_NAME: "svc"}
    if engine:
        resource[c.ENGINE] = engine
    for key, value in resource.items():
        resource_spans.resource.attributes.add(key=key).value.string_value = value
    span = resource_spans.scope_spans.add().spans.add(
        trace_id=os.urandom(16), span_id=os.urandom(8), name=name, kind=2,
        start_time_unix_nano=START, end_time_unix_nano=START + 2_000_000_000)
    for key, value in attributes.items():
        holder = span.attributes.add(key=key).value
        if isinstance(value, float):
            holder.double_value = value
        elif isinstance(value, int):
            holder.int_value = value
        else:
            holder.string_value = value
    return request


def _row(request: ExportTraceServiceRequest) -> dict:
    rows = normalize(request).rows["requests"]
    assert len(rows) == 1
    return dict(zip(TABLES["requests"], rows[0], strict=True))


LEGACY = {"gen_ai.usage.prompt_tokens": 40, "gen_ai.usage.completion_tokens": 9,
          "gen_ai.latency.time_in_queue": 0.25, "gen_ai.latency.time_to_first_token": 0.5,
          "gen_ai.latency.time_in_model_prefill": 0.2, "gen_ai.latency.time_in_model_decode": 0.8}
CURRENT = {c.INPUT_TOKENS: 40, c.OUTPUT_TOKENS: 9, c.CACHED_TOKENS: 16}


@pytest.mark.parametrize(("caption", "attributes"), [("legacy names", LEGACY), ("current names", CURRENT)])
def test_contract_request_span_reads_both_spellings(caption, attributes):
    row = _row(_payload(c.SPAN_REQUEST, {c.REQUEST_ID: "r-1", **attributes}, "mlx-lm"))
    assert (row["prompt_tokens"], row["completion_tokens"]) == (40, 9), caption
    if attributes is LEGACY:
        assert (row["queue_ms"], row["ttft_ms"], row["prefill_ms"], row["decode_ms"]) == (250.0, 500.0, 200.0, 800.0)


def test_current_names_win_over_legacy_ones():
    row = _row(_payload(c.SPAN_REQUEST, {c.REQUEST_ID: "r-2", c.INPUT_TOKENS: 12, "gen_ai.usage.prompt_tokens": 99,
                                         c.TTFT_MS: 7.0, "gen_ai.latency.time_to_first_token": 3.0}, "mlx-lm"))
    assert (row["prompt_tokens"], row["ttft_ms"]) == (12, 7.0)


@pytest.mark.parametrize(("caption", "attributes"), [("legacy names", LEGACY), ("current names", CURRENT)])
def test_vllm_native_span_reads_both_spellings(caption, attributes):
    row = _row(_payload("llm_request", {"gen_ai.request.id": "chatcmpl-abc", **attributes}, None))
    assert row["request_id"] == "abc"
    assert (row["prompt_tokens"], row["completion_tokens"]) == (40, 9), caption
    assert row["cached_tokens"] == (16 if attributes is CURRENT else None)


def test_mlx_request_span_carries_the_genai_attributes():
    from tokentrace.engine_shim.mlx.records import RequestRecord
    from tokentrace.engine_shim.mlx.spans import _request_attributes

    for endpoint, operation in (("/v1/chat/completions", "chat"), ("/v1/completions", "text_completion"),
                                ("/chat/completions", "chat")):
        record = RequestRecord(request_id="q-1", endpoint=endpoint, arrival_ns=1)
        attributes = _request_attributes(record)
        assert attributes[c.OPERATION_NAME] == operation
        assert attributes[c.PROVIDER_NAME] == c.ENGINE_MLX
        assert attributes[c.RESPONSE_ID] == "q-1"
        assert operation in c.ENUMS[c.OPERATION_NAME]
