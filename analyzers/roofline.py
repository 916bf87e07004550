"""Decode against the memory wall: the bandwidth a request's decode achieved against the machine's peak.

A decode step reads every weight once and the KV of every sequence in the batch, so (definitions,
docs/analyzers.md):
- ``steps_per_s``        = 1000 / TPOT (ms);
- ``mean_context``       = prompt tokens + completion tokens / 2 (the request's context, averaged over
  its decode);
- ``mean_batch``         = the mean number of sequences decoding in its engine steps (1, and
  ``batch_known`` false, when the engine reports no steps);
- ``kv_bytes_per_step``  = KV bytes per token × mean_context × mean_batch (the other sequences are
  taken to hold as long a context as this one);
- ``achieved_gbs``       = (weight bytes + kv_bytes_per_step) × steps_per_s / 10⁹;
- ``peak_gbs``           = the engine's declared ``tokentrace.host.memory_bandwidth_gbs``, else the
  published figure of its ``tokentrace.host.chip`` (tokentrace/hardware.py), else unknown (None, never 0);
- ``share_of_peak``      = achieved_gbs / peak_gbs (None when either is unknown).
Weight bytes come from the instance's latest ``model.load.weights`` (``tokentrace.load.bytes``); an
engine that reports none (vLLM today) leaves the achieved bandwidth unknown.
"""

from __future__ import annotations

import json
from typing import Any

from tokentrace import contract as c
from tokentrace.analyzers.evidence import Evidence
from tokentrace.collector.stores.store import TraceReader
from tokentrace.hardware import peak_bandwidth


def load_hardware(reader: TraceReader, instance_id: str | None, t_ns: int) -> dict[str, Any]:
    """Weight bytes, KV bytes per token, chip and declared peak of an instance at ``t_ns``."""
    weights = reader.rows("weights_at", instance_id=instance_id, t_ns=t_ns)
    kv = reader.rows("kv_per_token_at", instance_id=instance_id, t_ns=t_ns)
    resource = reader.rows("resource_at", instance_id=instance_id, t_ns=t_ns)
    attributes = json.loads(resource[0]["attributes"] or "{}") if resource else {}
    declared = attributes.get(c.HOST_MEMORY_BANDWIDTH_GBS)
    try:
        declared = float(declared) if declared not in (None, "") else None
    except (TypeError, ValueError):
        declared = None
    return {"weight_bytes": weights[0]["weight_bytes"] if weights else None,
            "kv_bytes_per_token": kv[0]["kv_bytes_per_token"] if kv else None,
            "chip": attributes.get(c.HOST_CHIP), "declared_gbs": declared}


def memory_bandwidth(request: dict, tpot_ms: float | None, steps: list[dict], hardware: dict) -> Evidence | None:
    """The ``memory_bandwidth`` evidence of a decode verdict (module docstring); None without a TPOT."""
    if not tpot_ms or tpot_ms <= 0:
        return None
    steps_per_s = 1000.0 / tpot_ms
    context = (request.get("prompt_tokens") or 0) + (request.get("completion_tokens") or 0) / 2
    batch_known = len(steps) > 0
    seqs = [row["decode_seqs"] for row in steps if row["decode_seqs"] is not None]  # as a mean over nulls
    batch = sum(seqs) / len(seqs) if seqs else 1.0
    weights, per_token = hardware["weight_bytes"], hardware["kv_bytes_per_token"]
    kv_step = per_token * context * batch if per_token else None
    achieved = None
    if weights is not None:
        achieved = (weights + (kv_step or 0)) * steps_per_s / 1e9
    peak, source = peak_bandwidth(hardware["chip"], hardware["declared_gbs"])
    share = achieved / peak if achieved is not None and peak else None
    data = {"achieved_gbs": None if achieved is None else round(achieved, 6), "peak_gbs": peak,
            "peak_source": source, "share_of_peak": None if share is None else round(share, 6),
            "chip": hardware["chip"], "weight_bytes": weights, "kv_bytes_per_token": per_token,
            "kv_bytes_per_step": None if kv_step is None else round(kv_step), "steps_per_s": round(steps_per_s, 3),
            "mean_batch": round(batch, 3), "batch_known": batch_known, "mean_context_tokens": round(context, 1)}
    if achieved is None:
        text = "Achieved memory bandwidth unknown: the engine reported no weight bytes."
    else:
        moved = f"Decode moved {achieved:.3g} GB/s ({weights:,} weight bytes"
        moved += f" + {kv_step:,.0f} KV bytes per step" if kv_step is not None else ", KV bytes unknown"
        moved += f" at {steps_per_s:.1f} steps/s)"
        if peak is None:
            text = f"{moved}; the machine's peak is unknown (no chip figure, no --memory-bandwidth-gbs)."
        else:
            where = "declared" if source == "declared" else f"published for {hardware['chip']}"
            text = f"{moved}: {share:.1%} of the peak {peak:g} GB/s ({where})."
    return Evidence("memory_bandwidth", text, data)
