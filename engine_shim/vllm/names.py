"""vLLM's own telemetry names, and how they map onto the tokentrace contract.

vLLM (0.30–0.32, V1 engine) emits, with ``--otlp-traces-endpoint``, one ``llm_request`` span per
finished request (``vllm/v1/engine/output_processor.py::OutputProcessor.do_tracing``; durations in
*seconds*) and model-loading spans named after the stage (``@instrument(span_name=...)`` across
``vllm/v1`` and ``vllm/model_executor``). Both the vLLM plugin and the collector (through this
engine's translation, ``translate.py``) read these names from here, so the two paths agree on
request ids and stages. Imports neither vLLM nor the collector.
"""

from __future__ import annotations

import re

from tokentrace import contract as c

# --- vLLM's native request span (vllm/tracing/utils.py::SpanAttributes) ---------------------------
SPAN_LLM_REQUEST = "llm_request"
LATENCY_TTFT = "gen_ai.latency.time_to_first_token"
LATENCY_E2E = "gen_ai.latency.e2e"
LATENCY_QUEUE = "gen_ai.latency.time_in_queue"
LATENCY_PREFILL = "gen_ai.latency.time_in_model_prefill"
LATENCY_DECODE = "gen_ai.latency.time_in_model_decode"
USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
REQUEST_ID = "gen_ai.request.id"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"

#: vLLM's seconds-valued latency attributes -> the contract's millisecond phase summary.
LATENCY_TO_CONTRACT_MS: dict[str, str] = {
    LATENCY_QUEUE: c.QUEUE_MS,
    LATENCY_PREFILL: c.PREFILL_MS,
    LATENCY_DECODE: c.DECODE_MS,
    LATENCY_TTFT: c.TTFT_MS,
}

#: Legacy GenAI usage names (vLLM still sends them) -> the current ones (the contract's).
LEGACY_USAGE: dict[str, str] = {USAGE_PROMPT_TOKENS: c.INPUT_TOKENS, USAGE_COMPLETION_TOKENS: c.OUTPUT_TOKENS}


def with_both_names(attributes: dict) -> dict:
    """A request span's attributes with each GenAI usage value under both its current and its
    legacy name (the current one wins), and vLLM's ``gen_ai.latency.*`` seconds as the contract's ms
    summaries where those are absent: a span in either spelling normalizes to the same row."""
    out = dict(attributes)
    for legacy, current in LEGACY_USAGE.items():
        value = out[current] if current in out else out.get(legacy)
        if value is not None:
            out[current] = out[legacy] = value
    for legacy, ms_key in LATENCY_TO_CONTRACT_MS.items():
        seconds = out.get(legacy)
        if ms_key not in out and isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
            out[ms_key] = seconds * 1e3
    return out


# --- vLLM's loading spans (PR #31162) -> contract load stages ---------------------------------------
#: Span name -> the contract stage it belongs to. Spans not listed (``Overall Loading``, ``Executor
#: init``, ``Worker init``, ...) are containers of these; they stay in the generic ``spans`` table.
LOAD_STAGE_BY_SPAN: dict[str, str] = {
    "Download weights - HF": c.SPAN_LOAD_RESOLVE,
    "Load weights": c.SPAN_LOAD_WEIGHTS,
    "Allocate KV cache": c.SPAN_LOAD_WARMUP,
    "Warmup (CPU)": c.SPAN_LOAD_WARMUP,
    "Warmup (GPU)": c.SPAN_LOAD_WARMUP,
    "Capture model": c.SPAN_LOAD_WARMUP,
    "Compile graph": c.SPAN_LOAD_WARMUP,
    "DeepGemm warmup": c.SPAN_LOAD_WARMUP,
}

# The OpenAI frontends build the engine request id from the X-Request-Id header (or a random id):
# chat "chatcmpl-{id}", completions "cmpl-{id}-{prompt index}", tokens-in "generate-tokens-{id}"
# (vllm/entrypoints/serve/engine/serving.py::_base_request_id and its callers in
# vllm/entrypoints/openai/{chat_completion,completion}/serving.py).
_PREFIXED = re.compile(r"^(?:chatcmpl-|cmpl-|generate-tokens-)(?P<rest>.+)$")
_COMPLETION_INDEX = re.compile(r"^(?P<base>.+)-(?P<index>\d+)$")


def client_request_id(vllm_request_id: str) -> str:
    """The id a client knows (its X-Request-Id) for vLLM's external request id.

    ``chatcmpl-X`` -> ``X``; ``cmpl-X-0`` -> ``X`` (the first prompt of a completion request);
    ``cmpl-X-2`` -> ``X-2`` so that the prompts of one batched completion keep distinct rows.
    Ids without a known prefix (offline ``LLM`` use) are returned unchanged.
    """
    match = _PREFIXED.match(vllm_request_id)
    if match is None:
        return vllm_request_id
    rest = match.group("rest")
    if vllm_request_id.startswith("cmpl-"):
        indexed = _COMPLETION_INDEX.match(rest)
        if indexed is not None and indexed.group("index") == "0":
            return indexed.group("base")
    return rest
