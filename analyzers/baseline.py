"""The slowness verdict's abnormal test over a window of requests at once (what the timeline marks).

``slowness.classify_slowness`` judges one request: its category's component against the median of
that component over the comparable requests among the instance's last BASELINE_LIMIT successful
ones in the BASELINE_WINDOW_NS before it (slowness.py's docstring, ``abnormal``). Read request by
request (``load_slow_facts``) and judged row by row (``slowness._baseline``), that costs about
0.1 ms a request before any read: seconds for the 20,000 requests a timeline holds. ``judge_abnormal``
applies the same rule to every request of a frame in one vectorized pass over the rows read once
(``history_of``); the test itself is ``slowness.exceeds``, shared, and the selection of each
request's baseline is checked against ``classify_slowness`` on generated stores
(tests/test_dashboard_pages.py). Unknown stays unknown: a request that did not complete, whose
category is ``undecomposed``, or that has fewer than MIN_SAMPLES comparable requests is not judged
(``abnormal`` null), never normal.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from tokentrace.analyzers.outcome import COMPLETED, outcome_expr
from tokentrace.analyzers.slowness import (
    BASELINE_LIMIT,
    BASELINE_WINDOW_NS,
    CATEGORIES,
    MIN_SAMPLES,
    exceeds,
)
from tokentrace.collector.stores.store import TraceReader

#: The columns of a requests row the test reads (baseline.sql's, and the instance).
COLUMNS = {"request_id": pl.String, "instance_id": pl.String, "start_ns": pl.Int64, "load_wait_ms": pl.Float64,
           "queue_ms": pl.Float64, "prefill_ms": pl.Float64, "tpot_ms": pl.Float64, "prompt_tokens": pl.Int64,
           "cached_tokens": pl.Int64, "completion_tokens": pl.Int64, "http_status": pl.Int64,
           "error_type": pl.String, "finish_reason": pl.String, "client_disconnected": pl.Boolean}
_COMPONENT = {label: name for name, label in CATEGORIES}


def _uncached() -> pl.Expr:
    """``slowness._uncached``: prompt tokens less cached ones, an unknown count as 0, never below 0."""
    return pl.max_horizontal(pl.col("prompt_tokens").fill_null(0) - pl.col("cached_tokens").fill_null(0), pl.lit(0))


def history_of(reader: TraceReader, frame: pl.DataFrame, window: pl.DataFrame) -> pl.DataFrame:
    """The rows ``judge_abnormal`` needs for the requests of ``frame``: ``window``, every request of
    their instances that started from the first of them on (whatever the page's slice), and per
    instance the baseline rows before its first request (baseline.sql, the verdict's own query)."""
    firsts = (frame.filter(pl.col("instance_id").is_not_null()).group_by("instance_id")
              .agg(pl.col("start_ns").min()).sort("instance_id").rows())
    before = reader.together(*[
        lambda instance=instance, t=t: reader.frame(
            "baseline", instance_id=instance, request_id="", since_ns=t - BASELINE_WINDOW_NS, before_ns=t,
            limit=BASELINE_LIMIT).with_columns(pl.lit(instance).alias("instance_id"))
        for instance, t in firsts])
    window = window.select([pl.col(name).cast(dtype) for name, dtype in COLUMNS.items()])
    before = [part.select([pl.col(name).cast(dtype) for name, dtype in COLUMNS.items()]) for part in before]
    # A row of the window may be among the baseline rows too (one the slice left out): once.
    earlier = pl.concat(before).filter(~pl.col("request_id").is_in(window["request_id"].implode())) if before \
        else window.clear()
    return pl.concat([earlier, window])


def _values(history: pl.DataFrame) -> pl.DataFrame:
    """Per instance, its successful requests in start order (``g``: their row), each with its
    comparable values per component (null: not comparable, or the value unknown)."""
    comparable = (outcome_expr() == COMPLETED) & (pl.col("load_wait_ms").fill_null(0.0) == 0)
    uncached = pl.col("uncached")
    return (history.filter(pl.col("instance_id").is_not_null()
                           & (pl.col("http_status").is_null() | (pl.col("http_status") < 400)))
            .sort("instance_id", "start_ns")
            .with_columns(_uncached().alias("uncached"), comparable.alias("comparable"))
            .select("instance_id", "start_ns", "uncached",
                    pl.int_range(pl.len()).alias("g"),
                    pl.when("comparable").then(pl.col("load_wait_ms")).alias("v_load_wait"),
                    pl.when("comparable").then(pl.col("queue_ms")).alias("v_queue"),
                    pl.when(pl.col("comparable") & (pl.col("completion_tokens").fill_null(0) >= 2))
                    .then(pl.col("tpot_ms")).alias("v_decode"),
                    pl.when(pl.col("comparable") & (uncached > 0))
                    .then(pl.col("prefill_ms") / uncached).alias("v_prefill")))


def _component(expr_of) -> pl.Expr:
    """One expression per component, chosen by the row's ``component``."""
    chosen = pl.when(pl.col("component") == "prefill").then(expr_of("prefill"))
    for name in ("decode", "load_wait", "queue"):
        chosen = chosen.when(pl.col("component") == name).then(expr_of(name))
    return chosen


def _members(lo: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every member of the ranges [lo, end), in order: (its range's position, its index)."""
    lengths = np.maximum(end - lo, 0)
    which = np.repeat(np.arange(len(lengths)), lengths)
    return which, np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths - lo, lengths)


def _medians(judged: pl.DataFrame, values: pl.DataFrame, name: str) -> pl.DataFrame:
    """Per request judged on component ``name``: its comparable values' count and two middle ones."""
    judged = judged.sort("row")  # so that the members' rows are sorted, which polars groups fastest
    which, index = _members(judged["lo"].to_numpy(), judged["end"].to_numpy())
    rows = pl.DataFrame({"row": pl.Series(judged["row"].to_numpy()[which]).set_sorted(),
                         "v": values[f"v_{name}"].gather(index)})
    if name == "prefill":  # compared with requests of a similar uncached length only (within 4x)
        mine, theirs = judged["target_uncached"].to_numpy()[which], values["uncached"].gather(index).to_numpy()
        rows = rows.filter(pl.Series((mine / 4 <= theirs) & (theirs <= mine * 4)))
    # evidence.median: the middle value, or the mean of the two middle ones (exactly so: polars'
    # median interpolates otherwise in the last bit).
    return rows.drop_nulls("v").group_by("row").agg(pl.len().alias("n"),
                                                    pl.col("v").quantile(0.5, "lower").alias("lo_v"),
                                                    pl.col("v").quantile(0.5, "higher").alias("hi_v"))


def judge_abnormal(frame: pl.DataFrame, history: pl.DataFrame) -> pl.DataFrame:
    """Per row of ``frame`` (requests rows as stored, with their ``category``: ``report.with_categories``),
    in its order: ``abnormal`` (null: not judged), ``observed`` and ``baseline`` (the compared metric
    of the request and the median of its comparable requests: ms for load_wait and queue, ms per
    uncached token for prefill, TPOT in ms for decode; as the verdict's ``baseline``, to 4 decimals),
    ``samples`` (its comparable requests; null when its category names no component). ``history``:
    the instances' requests rows from BASELINE_WINDOW_NS before the first row of ``frame``
    (``history_of``)."""
    values = _values(history)
    raw = {"prefill": pl.col("prefill_ms").fill_null(0.0) / pl.col("scale"),
           "decode": pl.col("tpot_ms").fill_null(0.0)}
    targets = (frame.select(pl.int_range(pl.len()).alias("row"), "instance_id", "start_ns",
                            pl.col("category").replace_strict(_COMPONENT, default=None).alias("component"),
                            "prefill_ms", "tpot_ms", "load_wait_ms", "queue_ms",
                            pl.max_horizontal(_uncached(), pl.lit(1)).alias("target_uncached"))
               .with_columns(pl.when(pl.col("component") == "prefill").then(pl.col("target_uncached"))
                             .otherwise(1).alias("scale"))
               .with_columns(_component(lambda name: raw.get(name, pl.col(f"{name}_ms").fill_null(0.0)))
                             .alias("observed_raw")))
    # Each request's baseline rows: [lo, end) of its instance's successful requests (``g``, their
    # row in ``values``), end the first that did not start before it, lo the first in the window
    # before it, at most LIMIT back. (Both sides are sorted by time as a whole, so within each
    # instance too, which polars cannot check.)
    keys = values.select("instance_id", "start_ns", "g").sort("start_ns", maintain_order=True)
    judged = (targets.filter(pl.col("component").is_not_null() & pl.col("instance_id").is_not_null())
              .sort("start_ns")
              .join_asof(keys.rename({"g": "last"}), on="start_ns", by="instance_id", strategy="backward",
                         allow_exact_matches=False, check_sortedness=False)
              .with_columns((pl.col("start_ns") - BASELINE_WINDOW_NS).alias("since")).sort("since")
              .join_asof(keys.rename({"g": "first", "start_ns": "since"}), on="since", by="instance_id",
                         strategy="forward", check_sortedness=False))
    end = (pl.col("last") + 1).fill_null(0)
    lo = pl.when(pl.col("last").is_null() | pl.col("first").is_null()).then(end) \
        .otherwise(pl.max_horizontal(pl.col("first"), end - BASELINE_LIMIT))
    judged = judged.with_columns(end.alias("end"), lo.alias("lo"))
    medians = [_medians(part, values, name) for (name,), part in judged.group_by("component")]
    schema = {"row": pl.Int64, "n": pl.UInt32, "lo_v": pl.Float64, "hi_v": pl.Float64}
    out = targets.join(pl.concat([m.cast(schema) for m in medians]) if medians else pl.DataFrame(schema=schema),
                       on="row", how="left").sort("row")
    base = (pl.col("lo_v") + pl.col("hi_v")) / 2
    test = _component(lambda name: exceeds(name, pl.col("observed_raw"), base, pl.col("scale")))
    known = pl.col("component").is_not_null()
    return out.select(
        pl.when(known & (pl.col("n").fill_null(0) >= MIN_SAMPLES)).then(test).alias("abnormal"),
        pl.when(known).then(pl.col("observed_raw").round(4)).alias("observed"),
        pl.when(known).then(base.round(4)).alias("baseline"),
        pl.when(known).then(pl.col("n").fill_null(0)).alias("samples"),
    )
