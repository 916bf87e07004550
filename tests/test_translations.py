"""Engine translations live with their engine: the collector core names no engine, and the normalizer
finds an engine's span names through the registry (tokentrace.engine_shim.translations)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace.collector.decoding import normalize
from tokentrace.engine_shim import translations

ROOT = Path(__file__).resolve().parents[1]


def test_the_collector_core_holds_no_native_span_name_of_an_engine():
    for path in sorted((ROOT / "collector").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"llm_request|Load weights|gen_ai\.latency", text), path.name


def _request(span_name: str) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    attribute = resource_spans.resource.attributes.add()
    attribute.key, attribute.value.string_value = "service.instance.id", "box-1"
    span = resource_spans.scope_spans.add().spans.add()
    span.name, span.trace_id, span.span_id = span_name, b"\x01" * 16, b"\x02" * 8
    span.start_time_unix_nano, span.end_time_unix_nano = 1_000, 2_000
    return request


@pytest.fixture
def registry(monkeypatch):
    """The registry with a throw-away engine module added; restored afterwards."""
    module = types.ModuleType("tokentrace_test_engine")

    def heartbeat_row(scope, span, attributes, ids):
        scope.batch.rows["instance_events"].append(
            (scope.instance_id, scope.service_name, span.end_time_unix_nano, "instance.ready", None, span.name))

    module.BUILDERS = {"box.alive": heartbeat_row}
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(translations.TRANSLATIONS, "box", module.__name__)
    translations.builders.cache_clear()
    yield module
    monkeypatch.undo()
    translations.builders.cache_clear()


def test_a_registered_engine_translates_its_spans_without_touching_the_core(registry):
    batch = normalize.normalize(_request("box.alive"))
    assert batch.rows["instance_events"] == [("box-1", None, 2_000, "instance.ready", None, "box.alive")]
    assert len(batch.rows["spans"]) == 1  # and the span itself is kept, as every span is


def test_an_unregistered_span_stays_in_spans_only():
    batch = normalize.normalize(_request("box.alive"))
    assert batch.rows["instance_events"] == [] and len(batch.rows["spans"]) == 1


def test_two_engines_claiming_one_span_name_is_refused(registry, monkeypatch):
    monkeypatch.setitem(translations.TRANSLATIONS, "box-2", registry.__name__)
    translations.builders.cache_clear()
    with pytest.raises(ValueError, match=r"'box\.alive' is translated by both box and box-2"):
        translations.builder("box.alive")


def test_vllm_names_are_found_through_the_registry():
    from tokentrace.engine_shim.vllm import names

    assert translations.builder(names.SPAN_LLM_REQUEST) is not None
    assert {translations.builder(name) for name in names.LOAD_STAGE_BY_SPAN} != {None}
