"""What became of a request, and which of its parts are known (docs/analyzers.md, "Outcome").

Definitions (the contract; tests check them), from the request row, the first that holds:
- ``cancelled``: the client went away (``client_disconnected``), the answer was HTTP 499, or the
  engine's finish reason says it was cancelled or aborted;
- ``rejected``: any other 4xx answer (the engine refused it: context too long, unknown model, bad
  input, rate limit);
- ``failed``: a 5xx answer, an ``error.type``, or the finish reason ``error``;
- ``completed``: everything else.
Only completed requests get a slowness category, enter latency percentiles and cache hit rates.

Unknown is not zero: a phase a request row does not carry stays missing. Each resource may declare
the parts its observer measures (``tokentrace.observer.measures``, docs/telemetry.md); a part the
declaration leaves out is unknown even when a row carries a value for it.

A part that cannot be the largest does not block naming the largest (``largest_part``). The four
phases are disjoint intervals inside the request, and load_wait, queue and prefill all end by the
first token, so an unknown part is at most what the known parts leave of the end-to-end time
(``e2e - sum(known)``) and, for load_wait, queue and prefill, of TTFT (``ttft - sum(known of those
three)``), never below 0 (``unknown_bounds``). When the largest known part is larger than every
unknown part's bound it is the largest, whatever the unknown parts were; otherwise a completed
request is ``undecomposed``: an unknown part could still be the largest. Time in no phase counts
the same way: when every phase is known and what they leave of the end-to-end time
(``unattributed``: ``other`` in the breakdown) is larger than the largest, that largest is not where
the request's time went, and the request is ``undecomposed`` too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

from tokentrace import contract as c

if TYPE_CHECKING:  # polars only where frames are built: ``analyze --url`` never imports it (issue 17)
    import polars as pl

COMPLETED, REJECTED, FAILED, CANCELLED = "completed", "rejected", "failed", "cancelled"
OUTCOMES = (COMPLETED, REJECTED, FAILED, CANCELLED)
#: Finish reasons that mean the request was stopped before it ended on its own (ours, vLLM's).
CANCEL_REASONS = ("cancelled", "abort", "aborted")
#: The slowness category of a completed request whose four components are not all known.
UNDECOMPOSED = "undecomposed"
#: The per-request parts an observer can declare (``tokentrace.observer.measures``).
PARTS = c.OBSERVER_PARTS
#: The four phases, in the order ties between equal parts are broken.
PHASES = ("load_wait", "queue", "prefill", "decode")
#: The phases that end by the first generated token: together they are at most TTFT.
BEFORE_FIRST_TOKEN = ("load_wait", "queue", "prefill")


def outcome_of(row: dict) -> str:
    """The outcome of one request row (definition in the module docstring)."""
    status, reason = row.get("http_status"), row.get("finish_reason")
    if row.get("client_disconnected") or status == 499 or reason in CANCEL_REASONS:
        return CANCELLED
    if status is not None and 400 <= status < 500:
        return REJECTED
    if (status is not None and status >= 500) or row.get("error_type") or reason == "error":
        return FAILED
    return COMPLETED


def outcome_expr() -> pl.Expr:
    """``outcome_of`` over a requests frame, vectorized (same rule)."""
    import polars as pl

    status, reason = pl.col("http_status"), pl.col("finish_reason")
    cancelled = (pl.col("client_disconnected").fill_null(False) | (status == 499).fill_null(False)
                 | reason.is_in(list(CANCEL_REASONS)).fill_null(False))
    rejected = status.is_between(400, 499).fill_null(False)
    failed = ((status >= 500).fill_null(False) | pl.col("error_type").is_not_null()
              | (reason == "error").fill_null(False))
    return (pl.when(cancelled).then(pl.lit(CANCELLED)).when(rejected).then(pl.lit(REJECTED))
            .when(failed).then(pl.lit(FAILED)).otherwise(pl.lit(COMPLETED)))


def measures_of(attributes: str | dict | None) -> frozenset[str] | None:
    """The parts a resource declares its observer measures; None when it declares nothing."""
    if isinstance(attributes, str):
        try:
            attributes = json.loads(attributes)
        except ValueError:
            return None
    value = (attributes or {}).get(c.OBSERVER_MEASURES)
    if not isinstance(value, list):
        return None
    return frozenset(str(part) for part in value if part in PARTS)


def observers(rows: Iterable[dict]) -> dict[str | None, frozenset[str] | None]:
    """instance id -> declared parts, from the ``observers`` named query's rows."""
    return {row["instance_id"]: measures_of(row["attributes"]) for row in rows}


def known_parts(row: dict, measures: frozenset[str] | None) -> dict[str, float | None]:
    """The row's ``{part}_ms`` values, None where unknown: missing, or not declared measured."""
    return {part: (None if measures is not None and part not in measures else row.get(f"{part}_ms"))
            for part in PARTS}


def unknown_bounds(known: dict[str, float | None], e2e_ms: float | None) -> dict[str, float | None]:
    """The most each unknown phase of ``known`` (``known_parts``) can be: what the known phases leave
    of ``e2e_ms`` and, for load_wait, queue and prefill, of TTFT (the lesser), never below 0; None
    when neither total is known. Known phases are left out."""
    return {part: None if bound is None else round(bound, 3) for part, bound in _bounds(known, e2e_ms).items()}


def _bounds(known: dict[str, float | None], e2e_ms: float | None) -> dict[str, float | None]:
    """``unknown_bounds`` unrounded (what ``largest_part`` and ``report.with_categories`` compare)."""
    rest_e2e = None if e2e_ms is None else e2e_ms - sum(known[p] or 0.0 for p in PHASES)
    ttft = known.get("ttft")
    rest_ttft = None if ttft is None else ttft - sum(known[p] or 0.0 for p in BEFORE_FIRST_TOKEN)
    bounds: dict[str, float | None] = {}
    for part in PHASES:
        if known[part] is not None:
            continue
        totals = [rest for rest in (rest_e2e, rest_ttft if part in BEFORE_FIRST_TOKEN else None)
                  if rest is not None]
        bounds[part] = max(0.0, min(totals)) if totals else None
    return bounds


def unattributed(known: dict[str, float | None], e2e_ms: float | None,
                 components: tuple[str, ...] = PHASES) -> float | None:
    """Time in none of ``components``, all of them known: what they leave of the end-to-end time
    (of TTFT, for the parts before the first token), never below 0; None while one is unknown."""
    if any(known[part] is None for part in components):
        return None
    total = known.get("ttft") if set(components) <= set(BEFORE_FIRST_TOKEN) else e2e_ms
    return None if total is None else max(0.0, total - sum(known[part] or 0.0 for part in components))


def largest_part(known: dict[str, float | None], e2e_ms: float | None,
                 components: tuple[str, ...] = PHASES) -> str | None:
    """The largest of ``components`` (ties to the earlier one), or None when an unknown one could be
    the largest: its bound (``unknown_bounds``) is unknown or not below the largest known part; or,
    all of them known, when more time is in none of them (``unattributed``) than in the largest."""
    values = {part: known[part] for part in components if known[part] is not None}
    if not values:
        return None
    best = max(values, key=lambda part: (values[part], -components.index(part)))
    bounds = _bounds(known, e2e_ms)
    if any(bounds[part] is None or bounds[part] >= values[best] for part in components if part in bounds):
        return None
    rest = unattributed(known, e2e_ms, components)
    if rest is not None and rest > values[best]:
        return None
    return best


def mask_unmeasured(frame: pl.DataFrame, declared: dict[str | None, frozenset[str] | None]) -> pl.DataFrame:
    """A requests frame with each ``{part}_ms`` nulled on rows whose instance declares it does not
    measure that part (instances that declare nothing keep their values)."""
    import polars as pl

    columns = []
    for part in PARTS:
        blind = [instance for instance, parts in declared.items()
                 if instance is not None and parts is not None and part not in parts]
        if blind and f"{part}_ms" in frame.columns:
            column = pl.col(f"{part}_ms")
            columns.append(pl.when(pl.col("instance_id").is_in(blind)).then(None).otherwise(column)
                           .alias(f"{part}_ms"))
    return frame.with_columns(columns) if columns else frame
