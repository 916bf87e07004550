"""vLLM's native spans translated into the contract's rows: this engine's part of the collector's
normalizer (docs/vllm.md, "What the collector does with vLLM's own spans").

The normalizer finds ``BUILDERS`` through the engine registry (``tokentrace.engine_shim.translations``),
so the collector core holds no vLLM name (STYLE §20). No vLLM import: the collector loads this module.
"""

from __future__ import annotations

from tokentrace import contract as c
from tokentrace.collector.decoding.normalize import Scope, as_int, as_ms, as_str
from tokentrace.engine_shim.vllm.names import (
    LATENCY_TO_CONTRACT_MS,
    LOAD_STAGE_BY_SPAN,
    REQUEST_ID,
    REQUEST_MAX_TOKENS,
    SPAN_LLM_REQUEST,
    USAGE_COMPLETION_TOKENS,
    USAGE_PROMPT_TOKENS,
    client_request_id,
    with_both_names,
)


def request_row(scope: Scope, span, a: dict, ids: tuple) -> None:
    """vLLM's ``llm_request`` span (``--otlp-traces-endpoint``) as a request row.

    Latencies arrive in seconds. A resource naming ``tokentrace.engine`` comes from a vLLM running
    the tokentrace plugin, whose own ``llm.request`` (with cached tokens) is the row; this span then
    stays in ``spans`` only, so that a request is never counted twice.
    """
    if scope.engine is not None:
        return
    a = with_both_names(a)
    ms = {key: as_ms(scope, a, name, 1e3) for name, key in LATENCY_TO_CONTRACT_MS.items()}
    outputs = as_int(a.get(USAGE_COMPLETION_TOKENS))
    decode = ms[c.DECODE_MS]
    tpot = decode / (outputs - 1) if decode is not None and outputs is not None and outputs > 1 else None
    raw_id = as_str(a.get(REQUEST_ID))
    scope.batch.rows["requests"].append((
        client_request_id(raw_id) if raw_id else ids[1], ids[0], ids[1], scope.instance_id,
        scope.service_name, c.ENGINE_VLLM, scope.model, None, None,
        span.start_time_unix_nano, span.end_time_unix_nano,
        ms[c.QUEUE_MS], 0.0, ms[c.PREFILL_MS], decode, ms[c.TTFT_MS], tpot,
        as_int(a.get(USAGE_PROMPT_TOKENS)), as_int(a.get(c.CACHED_TOKENS)), outputs,
        as_int(a.get(REQUEST_MAX_TOKENS)),
        None, None, None, None, None, None, c.OBSERVER_NATIVE, None,
    ))


def load_stage_row(scope: Scope, span, a: dict, ids: tuple) -> None:
    """One of vLLM's loading spans as a stage of the ``model.load`` its trace belongs to.

    The vLLM plugin starts that trace for ``model.load`` and uses the trace id as the load id, so
    the stage needs no join; the row is named by the contract stage, the vLLM name stays in
    ``spans``.
    """
    scope.batch.rows["load_stages"].append((
        ids[0], scope.instance_id, *ids, LOAD_STAGE_BY_SPAN[span.name], span.start_time_unix_nano,
        span.end_time_unix_nano, None,
    ))


#: Span name -> row builder, read by the collector's normalizer through the engine registry.
BUILDERS = {SPAN_LLM_REQUEST: request_row, **dict.fromkeys(LOAD_STAGE_BY_SPAN, load_stage_row)}
