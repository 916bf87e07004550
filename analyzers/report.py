"""The window report: categories and causes, slowest requests, per-instance latency, cache reuse.

Outcomes and categories are computed for every request of the window in one vectorized pass (the
same rules as ``outcome.outcome_of`` and ``slowness.classify_slowness``: the largest component,
ties in the order load_wait, queue, prefill, decode; ``undecomposed`` when an unknown component
could be the largest: its bound, ``outcome.unknown_bounds``, is not below the largest known one). Only
completed requests enter the categories, latency percentiles, the token hit rate, the slowest list
and the cache causes; the others are counted per outcome. Cache causes need a full cache verdict per
request, so they are counted over the most recent ``cause_sample`` completed requests that did not
reuse their whole prompt, and the report says so.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from tokentrace.analyzers.cache import NO_CAUSE, analyze_cache
from tokentrace.analyzers.outcome import COMPLETED, UNDECOMPOSED, mask_unmeasured, observers, outcome_expr
from tokentrace.analyzers.slo import SloSpec, attainment
from tokentrace.analyzers.slowness import CATEGORIES
from tokentrace.collector.stores.store import TraceReader
from tokentrace.threads import name_os_thread
from tokentrace.window import Slice

_COMPONENTS = [name for name, _ in CATEGORIES]


@dataclass
class Report:
    """A window's summary (all durations in ms)."""

    since_ns: int | None
    until_ns: int | None
    requests: int  #: every request that started in the window, whatever its outcome
    outcomes: dict[str, int]  #: requests per outcome (completed, rejected, failed, cancelled)
    categories: dict[str, int]  #: completed requests per slowness category (undecomposed included)
    causes: dict[str, int]  #: cache causes over the sampled requests (no cause counted as "none")
    cause_sample: int  #: how many requests the causes were computed over
    cache: dict[str, Any]  #: token hit rate, requests with any reuse / none
    #: per instance: count; p50 p95 p99 of ttft_ms (time to first token: the engine's first generated
    #: token), first_content_ms (time to first content: the first chunk with answer text, the client's
    #: TTFT), tpot_ms and e2e_ms; output tokens/s
    instances: list[dict[str, Any]]
    slowest: list[dict[str, Any]] = field(default_factory=list)  #: top requests by e2e
    slo: dict[str, Any] | None = None  #: attainment and goodput (analyzers.slo), when objectives are set
    routing: list[dict[str, Any]] = field(default_factory=list)
    """Per gateway routing policy: decisions, avoidable prefill tokens summed, decisions with any,
    decisions measured, mean gateway wait (docs/gateway.md); empty without a gateway."""
    #: the requests beyond the window: instance_id, model, session_id, request_prefix (None: any)
    slice: dict[str, Any] = field(default_factory=lambda: Slice().params())

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return dict(vars(self))


def with_categories(frame: pl.DataFrame, declared: dict | None = None) -> pl.DataFrame:
    """Add ``e2e_ms``, ``outcome`` and ``category`` columns to a requests frame (vectorized rules):
    ``category`` is null unless the request completed, ``undecomposed`` when a component is unknown
    and could be the largest, or when more time is in no component than in the largest.
    ``declared`` (instance -> parts, ``outcome.observers``) nulls the parts an observer does not
    measure first."""
    frame = mask_unmeasured(frame, declared or {})
    parts = [pl.col(f"{name}_ms") for name in _COMPONENTS]
    best = pl.max_horizontal(parts)
    # outcome.unknown_bounds, vectorized: what the known parts leave of e2e (and of TTFT for the
    # parts before the first token); the largest bound among the unknown parts, null when none is.
    rest_e2e = pl.col("e2e_ms") - pl.sum_horizontal([part.fill_null(0.0) for part in parts])
    rest_ttft = pl.col("ttft_ms") - pl.sum_horizontal([part.fill_null(0.0) for part in parts[:3]])
    before = pl.max_horizontal(pl.min_horizontal(rest_e2e, rest_ttft), pl.lit(0.0))
    bound = pl.max_horizontal(pl.when(parts[3].is_null()).then(pl.max_horizontal(rest_e2e, pl.lit(0.0))),
                              pl.when(pl.any_horizontal([part.is_null() for part in parts[:3]])).then(before))
    # The first component equal to the maximum wins: ties go to the earlier one in CATEGORIES.
    # outcome.unattributed: every part known, and more time in none of them than in the largest.
    spare = pl.all_horizontal([part.is_not_null() for part in parts]) & (rest_e2e > best)
    category = pl.when(pl.col("outcome") != COMPLETED).then(None)
    category = category.when(bound.is_not_null() & (best.is_null() | (bound >= best))).then(pl.lit(UNDECOMPOSED))
    category = category.when(spare.fill_null(False)).then(pl.lit(UNDECOMPOSED))
    for part, (_, label) in zip(parts, CATEGORIES, strict=True):
        category = category.when(part == best).then(pl.lit(label))
    return (frame.with_columns(((pl.col("end_ns") - pl.col("start_ns")) / 1e6).alias("e2e_ms"),
                               outcome_expr().alias("outcome"))
            .with_columns(category.otherwise(pl.lit(CATEGORIES[-1][1])).alias("category")))


def declared_parts(reader: TraceReader) -> dict:
    """instance -> the parts its observer declares (``outcome.observers``), for ``with_categories``."""
    return observers(reader.frame("observers", instance_id=None).iter_rows(named=True))


def percentiles(column: pl.Series) -> dict[str, float | None]:
    """p50, p95 and p99 of a column (nulls left out; None when nothing is left)."""
    clean = column.drop_nulls()
    if clean.is_empty():
        return {"p50": None, "p95": None, "p99": None}
    return {f"p{q}": round(float(clean.quantile(q / 100, "nearest")), 3) for q in (50, 95, 99)}


def with_first_content(frame: pl.DataFrame) -> pl.DataFrame:
    """A requests frame with a ``first_content_ms`` column: null where it had none (unknown, not 0)."""
    if "first_content_ms" in frame.columns:
        return frame
    return frame.with_columns(pl.lit(None, dtype=pl.Float64).alias("first_content_ms"))


def reuse_known(frame: pl.DataFrame) -> pl.DataFrame:
    """The rows of a requests frame whose prompt and cached token counts are both known: a count
    an engine did not report is unknown, not 0, and stays out of hit rates."""
    return frame.filter(pl.col("prompt_tokens").is_not_null() & pl.col("cached_tokens").is_not_null())


def token_hit_rate(frame: pl.DataFrame) -> float | None:
    """Prompt tokens served from the cache over all prompt tokens, over the rows of a requests frame
    that know both counts (``reuse_known``)."""
    known = reuse_known(frame)
    prompt = known["prompt_tokens"].sum()
    return round(known["cached_tokens"].sum() / prompt, 4) if prompt else None


def cause_candidates(frame: pl.DataFrame, sample: int) -> pl.DataFrame:
    """The requests whose cache cause a window's count is made of: the latest ``sample`` that did
    not reuse their whole prompt, among the completed ones."""
    frame = frame.filter(pl.col("outcome") == COMPLETED)
    prompt, cached = frame["prompt_tokens"].fill_null(0), frame["cached_tokens"].fill_null(0)
    # top_k, not a sort of the whole window: the same rows (ties aside, as before), in linear time.
    return frame.filter(cached < prompt - 1).top_k(sample, by="start_ns").sort("start_ns", descending=True)


def summarize(reader: TraceReader, since_ns: int | None, until_ns: int | None = None, slowest: int = 10,
              cause_sample: int = 25, limit: int = 1_000_000, slo: SloSpec | None = None,
              where: Slice | None = None) -> Report:
    """The report over requests that started in [since, until), of the slice ``where``."""
    where = where or Slice()
    frame = reader.bulk("requests_report", since_ns=since_ns, until_ns=until_ns, limit=limit, **where.params())
    return summarize_frame(reader, with_categories(frame, declared_parts(reader)), since_ns, until_ns, slowest,
                           cause_sample, slo, where)


def summarize_frame(reader: TraceReader, frame: pl.DataFrame, since_ns: int | None, until_ns: int | None = None,
                    slowest: int = 10, cause_sample: int = 25, slo: SloSpec | None = None,
                    where: Slice | None = None) -> Report:
    """``summarize`` over a requests frame already read and given its categories (``with_categories``)."""
    where = where or Slice()
    if frame.height == 0:
        return Report(since_ns, until_ns, 0, {}, {}, {}, 0, {"token_hit_rate": None}, [], [],
                      attainment(frame, slo, None) if slo else None, slice=where.params())
    outcomes = dict(sorted(frame.group_by("outcome").len().iter_rows()))
    frame = with_first_content(frame)
    whole = frame
    frame = frame.filter(pl.col("outcome") == COMPLETED)
    categories = dict(frame.group_by("category").len().iter_rows())
    cached = frame["cached_tokens"].fill_null(0)
    known = reuse_known(frame)
    cache = {
        "token_hit_rate": token_hit_rate(frame),
        "requests_with_reuse": int((cached > 0).sum()),
        "requests_without_reuse": int((cached == 0).sum()),
        # Over the requests that know both counts (vllm:prefix_cache_queries/_hits on /metrics).
        "prompt_tokens": int(known["prompt_tokens"].sum()),
        "cached_tokens": int(known["cached_tokens"].sum()),
    }
    span_s = max(1e-9, (whole["end_ns"].max() - whole["start_ns"].min()) / 1e9)
    instances = []
    for (instance,), group in frame.group_by(["instance_id"], maintain_order=True):
        instances.append({
            "instance_id": instance, "requests": group.height,
            "ttft_ms": percentiles(group["ttft_ms"]), "first_content_ms": percentiles(group["first_content_ms"]),
            "tpot_ms": percentiles(group["tpot_ms"]),
            "e2e_ms": percentiles(group["e2e_ms"]),
            "output_tokens_per_s": round(group["completion_tokens"].fill_null(0).sum() / span_s, 2),
        })
    # Equal durations: the earlier request first (as the stable sort of the whole window gave).
    top = (frame.top_k(slowest, by=["e2e_ms", "start_ns"], reverse=[False, True])
           .sort(["e2e_ms", "start_ns"], descending=[True, False], maintain_order=True))
    slow_rows = top.select(
        "request_id", "instance_id", "category", "e2e_ms", "ttft_ms", "first_content_ms", "tpot_ms", "prompt_tokens",
        "cached_tokens", "completion_tokens").to_dicts()
    causes: dict[str, int] = {}
    sample = cause_candidates(frame, cause_sample)
    # The store runs each query with the GIL released, and every thread reads through its own
    # cursor (reader contract): two threads use both cores of a small machine.
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokentrace-report", initializer=name_os_thread) as pool:
        for verdict in pool.map(lambda rid: analyze_cache(reader, rid), sample["request_id"].to_list()):
            cause = verdict.cause or NO_CAUSE
            causes[cause] = causes.get(cause, 0) + 1
    return Report(since_ns, until_ns, whole.height, outcomes, categories, causes, sample.height, cache,
                  sorted(instances, key=lambda row: str(row["instance_id"])), slow_rows,
                  attainment(whole, slo, span_s) if slo else None,
                  routing_by_policy(reader, since_ns, until_ns, where), slice=where.params())


def routing_by_policy(reader: TraceReader, since_ns: int | None, until_ns: int | None,
                      where: Slice | None = None) -> list[dict[str, Any]]:
    """The gateway's routing decisions per policy in the window and slice (``Report.routing``)."""
    where = where or Slice()
    rows = reader.frame("routing_by_policy", since_ns=since_ns, until_ns=until_ns, **where.params()).to_dicts()
    for row in rows:
        wait = row["mean_gateway_wait_ms"]
        row["mean_gateway_wait_ms"] = None if wait is None else round(float(wait), 3)
        row["avoidable_prefill_tokens"] = int(row["avoidable_prefill_tokens"] or 0)
    return rows
