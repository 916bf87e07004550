"""Service-level objectives: what the operator promised, and which requests kept the promise.

Syntax (``--slo``): groups separated by ``;``, each ``[SCOPE=NAME:]OBJECTIVE=DURATION,...``::

    ttft=2s,tpot=50ms,e2e=30s                      every request (ttft: the client's time to first content)
    ttft=2s,tpot=50ms;model=qwen-7b:ttft=1s        qwen-7b's TTFT objective is 1 s, the rest as above
    tpot=50ms;instance=mini-3:tpot=80ms            one slower machine gets its own TPOT objective

Objectives are ``ttft``, ``first_token``, ``tpot`` (mean time per output token) and ``e2e``;
durations take ``ms``, ``s`` or ``m``. For each objective the most specific group that names it
wins: instance, then model, then the unscoped group.

Two TTFTs, named (issue 44): ``ttft`` is the **client's** time to first content
(``first_content_ms``: arrival to the first response chunk carrying answer text), the TTFT a client
or a benchmark (aiperf) measures and compares with an objective; ``first_token`` is the
**engine's** time to first token (``ttft_ms``: arrival to the first token generated, what vLLM's
``time_to_first_token`` series measures). Before issue 44 ``ttft`` was judged on the engine's
figure, up to seconds earlier than what the client saw; the name is kept, and ``first_token`` is
the old meaning. Time to first content is never earlier than time to first token, so a request
whose observer did not measure its first content but whose first token already came after the
objective missed ``ttft`` (``measure`` says the verdict read ``ttft_ms``); one whose first token
came in time is unknown for ``ttft``.

Definitions (the contract; tests check them):
- A request *meets* an objective when its value is at most the objective; *misses* it when above.
  An objective whose value the request does not have (TPOT of a one-token answer, any value of a
  request that failed before answering) is neither met nor missed for it: unknown is not zero.
- A request is *good* when it completed (``outcome``: not rejected, failed or cancelled) and missed
  no objective that applied to it. ``goodput`` = good requests per second of the window's active span.
- ``attainment`` of an objective = met / (met + missed); of ``all`` = good / requests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokentrace.analyzers.outcome import COMPLETED, outcome_expr
from tokentrace.errors import ConfigError

if TYPE_CHECKING:  # polars only where frames are judged: ``analyze --url --slo`` never imports it (issue 17)
    import polars as pl

#: Objective name -> the requests-frame column (milliseconds) it is judged on.
OBJECTIVES = {"ttft": "first_content_ms", "first_token": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms"}
#: Objective name -> what it measures, in words (reports and pages say which TTFT an objective uses).
MEASURES = {"ttft": "time to first content (the client's TTFT)",
            "first_token": "time to first token (the engine's)",
            "tpot": "time per output token", "e2e": "end to end"}
#: An objective judged on a column that may be unknown, and the column that bounds it from below:
#: time to first content is never earlier than time to first token.
LOWER_BOUNDS = {"ttft": "ttft_ms"}
SCOPES = ("model", "instance")
_UNITS_MS = {"ms": 1.0, "s": 1000.0, "m": 60_000.0}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m)$")


@dataclass(frozen=True)
class SloSpec:
    """Parsed ``--slo``: objectives (ms) for every request, and overrides per model and instance."""

    text: str  #: the spec as given
    default: dict[str, float] = field(default_factory=dict)  #: objective -> ms
    model: dict[str, dict[str, float]] = field(default_factory=dict)  #: model -> objective -> ms
    instance: dict[str, dict[str, float]] = field(default_factory=dict)  #: instance id -> objective -> ms

    def names(self) -> list[str]:
        """Objectives named anywhere in the spec, in OBJECTIVES order."""
        named = set(self.default) | {k for g in (*self.model.values(), *self.instance.values()) for k in g}
        return [name for name in OBJECTIVES if name in named]

    def objectives_for(self, model: str | None, instance: str | None) -> dict[str, float]:
        """The objectives (ms) that apply to a request of ``model`` on ``instance``."""
        return {**self.default, **self.model.get(model or "", {}), **self.instance.get(instance or "", {})}


def _duration_ms(text: str, where: str) -> float:
    match = _DURATION.match(text.strip())
    if not match:
        raise ConfigError(f"--slo: {where} must be a duration such as 500ms, 2s or 1m, received {text!r}")
    return float(match.group(1)) * _UNITS_MS[match.group(2)]


def parse_slo(text: str | None) -> SloSpec | None:
    """``--slo`` text -> SloSpec (None when empty); ConfigError saying what was expected."""
    if text is None or not text.strip():
        return None
    spec = SloSpec(text.strip())
    for group in filter(None, (part.strip() for part in text.split(";"))):
        target, scope_name = spec.default, None
        head, sep, rest = group.partition(":")
        if sep:
            scope, eq, name = head.partition("=")
            if scope.strip() not in SCOPES or not eq or not name.strip():
                raise ConfigError(f"--slo: a scoped group starts with model=NAME: or instance=NAME:, received {head!r}")
            scope_name = name.strip()
            target = getattr(spec, scope.strip()).setdefault(scope_name, {})
            group = rest
        for item in filter(None, (part.strip() for part in group.split(","))):
            name, eq, value = item.partition("=")
            if name.strip() not in OBJECTIVES or not eq:
                raise ConfigError(f"--slo: objectives are ttft=, first_token=, tpot= and e2e=, received {item!r}")
            target[name.strip()] = _duration_ms(value, name.strip())
    if not spec.names():
        raise ConfigError(f"--slo names no objective, received {text!r}")
    return spec


def _threshold(spec: SloSpec, name: str) -> pl.Expr:
    """The objective (ms) per row: instance override, then model override, then the default."""
    import polars as pl

    expr = pl.lit(spec.default.get(name), dtype=pl.Float64)
    for model, objectives in spec.model.items():
        if name in objectives:
            expr = pl.when(pl.col("model") == model).then(pl.lit(objectives[name])).otherwise(expr)
    for instance, objectives in spec.instance.items():
        if name in objectives:
            expr = pl.when(pl.col("instance_id") == instance).then(pl.lit(objectives[name])).otherwise(expr)
    return expr


def succeeded() -> pl.Expr:
    """A request that completed (``outcome.outcome_of``: not rejected, failed or cancelled)."""
    return outcome_expr() == COMPLETED


def judge(frame: pl.DataFrame, spec: SloSpec) -> pl.DataFrame:
    """Add ``slo_<name>`` (True met, False missed, null unknown or not set) per objective and
    ``slo_good`` to a requests frame that has ``e2e_ms`` (``report.with_categories``)."""
    import polars as pl

    # A frame read without the client's TTFT (an older store's query) knows none: unknown, not 0.
    frame = frame.with_columns([pl.lit(None, dtype=pl.Float64).alias(column) for column in
                                {*OBJECTIVES.values(), *LOWER_BOUNDS.values()} - set(frame.columns)])
    columns = []
    for name in spec.names():
        value, limit = pl.col(OBJECTIVES[name]), _threshold(spec, name)
        judged = pl.when(limit.is_null()).then(None).when(value.is_not_null()).then(value <= limit)
        if name in LOWER_BOUNDS:  # unknown, but already past the objective at its lower bound: missed
            bound = pl.col(LOWER_BOUNDS[name])
            judged = judged.when(bound.is_not_null() & (bound > limit)).then(pl.lit(False))
        columns.append(judged.otherwise(None).alias(f"slo_{name}"))
    frame = frame.with_columns(columns)
    missed = pl.any_horizontal([pl.col(f"slo_{name}").not_().fill_null(False) for name in spec.names()])
    return frame.with_columns((succeeded() & missed.not_()).alias("slo_good"))


def attainment(frame: pl.DataFrame, spec: SloSpec, active_s: float | None) -> dict[str, Any]:
    """Per objective met/missed/unknown and attainment; ``all``: good requests, attainment, goodput."""
    judged = judge(frame, spec)
    result: dict[str, Any] = {"spec": spec.text, "objectives": {}}
    for name in spec.names():
        column = judged[f"slo_{name}"]
        met, missed = int(column.sum() or 0), int((~column.drop_nulls()).sum())
        result["objectives"][name] = {
            "measure": OBJECTIVES[name], "what": MEASURES[name],
            "met": met, "missed": missed, "unknown": judged.height - met - missed,
            "attainment": round(met / (met + missed), 4) if met + missed else None,
        }
    good = int(judged["slo_good"].sum() or 0) if judged.height else 0
    result["all"] = {
        "requests": judged.height, "good": good,
        "attainment": round(good / judged.height, 4) if judged.height else None,
        "goodput_rps": round(good / active_s, 4) if active_s else None,
    }
    return result


def missed_objectives(row: dict, spec: SloSpec | None) -> list[dict[str, Any]]:
    """The objectives one requests row missed: [{slo, objective_ms, observed_ms, measure}], where
    ``measure`` is the column observed (``ttft_ms`` for a ``ttft`` missed at its lower bound)."""
    if spec is None:
        return []
    row = {**row, "e2e_ms": (row["end_ns"] - row["start_ns"]) / 1e6}
    missed = []
    for name, limit in spec.objectives_for(row.get("model"), row.get("instance_id")).items():
        measure = OBJECTIVES[name]
        if row.get(measure) is None and name in LOWER_BOUNDS:
            measure = LOWER_BOUNDS[name]
        observed = row.get(measure)
        if observed is not None and observed > limit:
            missed.append({"slo": name, "objective_ms": limit, "observed_ms": round(observed, 3), "measure": measure})
    return missed
