"""The Python API for embedders: the same spans from stream_generate-style use, on the real SDK."""

from __future__ import annotations

import subprocess
import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tokentrace.engine_shim import Instrumentation, build_chat_prompt


@pytest.fixture
def captured():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@pytest.fixture
def loaded(tiny_model, captured):
    provider, exporter = captured
    shim = Instrumentation(provider)
    model, tokenizer = shim.load(str(tiny_model))
    return shim, model, tokenizer, exporter


def _by_name(exporter) -> dict[str, list]:
    spans: dict[str, list] = {}
    for span in exporter.get_finished_spans():
        spans.setdefault(span.name, []).append(span)
    return spans


def test_load_reports_its_stages_and_readiness(loaded):
    shim, _, _, exporter = loaded
    shim.close()
    spans = _by_name(exporter)
    load = spans["model.load"][0]
    assert [e.name for e in load.events] == ["instance.ready"]
    for stage in ("model.load.resolve", "model.load.weights", "model.load.tokenizer", "model.load.warmup"):
        child = spans[stage][0]
        assert child.parent.span_id == load.context.span_id
        assert load.start_time <= child.start_time <= child.end_time <= load.end_time


def test_stream_generate_yields_mlx_responses_and_emits_the_request_tree(loaded):
    shim, model, tokenizer, exporter = loaded
    prompt = build_chat_prompt(tokenizer, [{"role": "system", "content": "Be brief. " * 20},
                                           {"role": "user", "content": "Hello there"}], None, False)
    responses = list(shim.stream_generate(model, tokenizer, prompt, request_id="embed-1", max_tokens=6,
                                          prefill_step_size=32))
    assert len(responses) == 6 and responses[-1].finish_reason == "length"
    shim.close()
    spans = _by_name(exporter)
    request = spans["llm.request"][0]
    assert request.attributes["tokentrace.request.id"] == "embed-1"
    assert request.attributes["gen_ai.usage.input_tokens"] == len(prompt.tokens)
    assert request.attributes["gen_ai.usage.output_tokens"] == 6
    chunks = [s for s in spans["llm.prefill.chunk"] if s.attributes["tokentrace.request.id"] == "embed-1"]
    assert sum(c.attributes["tokentrace.chunk.tokens"] for c in chunks) == len(prompt.tokens)
    assert len(chunks) > 2
    decode = spans["llm.decode"][0]
    assert decode.attributes["tokentrace.decode.steps"] == 6
    assert len(decode.attributes["tokentrace.decode.step_offsets_ns"]) == 6
    lookup = spans["llm.cache.lookup"][0]
    assert list(lookup.attributes["tokentrace.segments.roles"]) == ["system", "user", "assistant"]
    for span in spans["llm.prefill"] + spans["llm.decode"] + spans["llm.cache.lookup"]:
        assert span.parent.span_id == request.context.span_id
        assert request.start_time <= span.start_time <= span.end_time <= request.end_time
    steps = spans["engine.steps"][0]
    assert sum(steps.attributes["tokentrace.steps.prefill_tokens"]) == len(prompt.tokens)


def test_stopping_early_is_recorded_as_cancelled(loaded):
    shim, model, tokenizer, exporter = loaded
    generator = shim.stream_generate(model, tokenizer, "Once upon a time", request_id="early", max_tokens=50)
    next(generator)
    generator.close()
    shim.close()
    request = next(s for s in exporter.get_finished_spans() if s.name == "llm.request")
    assert list(request.attributes["gen_ai.response.finish_reasons"]) == ["cancelled"]
    assert request.attributes["gen_ai.usage.output_tokens"] == 1


def test_a_callers_prompt_cache_counts_as_cached_without_a_fingerprint(loaded):
    from mlx_lm.models.cache import make_prompt_cache

    shim, model, tokenizer, exporter = loaded
    cache = make_prompt_cache(model)
    list(shim.stream_generate(model, tokenizer, "Tell me about Paris", max_tokens=2, prompt_cache=cache))
    held = cache[0].offset
    list(shim.stream_generate(model, tokenizer, " and Lyon", request_id="reuse", max_tokens=2, prompt_cache=cache))
    shim.close()
    lookup = next(s for s in exporter.get_finished_spans()
                  if s.name == "llm.cache.lookup" and s.attributes["tokentrace.request.id"] == "reuse")
    assert lookup.attributes["tokentrace.cache.matched_tokens"] == held
    assert lookup.attributes["tokentrace.cache.prompt_tokens"] > held
    assert "tokentrace.cache.block_hashes" not in lookup.attributes


def test_importing_the_package_loads_no_mlx_and_sets_no_provider():
    code = ("import sys, tokentrace.engine_shim as shim; from opentelemetry import trace; "
            "assert 'mlx' not in sys.modules and 'mlx_lm' not in sys.modules, 'mlx imported'; "
            "assert 'opentelemetry.sdk' not in sys.modules, 'sdk imported'; "
            "assert type(trace.get_tracer_provider()).__name__ == 'ProxyTracerProvider'; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "ok", result.stderr
