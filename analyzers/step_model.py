"""How long an instance's decode step takes as a function of its batch, fitted on the instance's own
engine steps, and a slot model in which a larger batch makes each decode step slower: what the
advice's concurrency lever (advise.py) prices a larger ``--max-batch`` with (issue 47 item 1).

The fit: the instance's decode steps (steps that decoded one sequence or more and prefilled none:
a prefill chunk would add its own time) grouped by how many sequences decoded in them; per size
the median duration; a least-squares line through those medians, each weighted by its number of
steps: ``step_ms(n) = intercept_ms + per_sequence_ms * n``. A negative slope is noise (a step of
more sequences does not run faster) and is taken as flat (``flattened``). One size alone gives no
slope, so no model: how much slower a larger batch runs is then unknown, not zero. Past the largest
batch measured the line is extrapolated, and flagged (``extrapolated``): a larger limit is nearly
always beyond what an instance ran, and a decode step grows about linearly with its batch while it is
memory-bound (the weights read once per step, each sequence's KV on top).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import polars as pl

from tokentrace.analyzers.evidence import median

#: Phase lengths below this (ms) count as done (floating-point remainders of the simulation).
_EPS_MS = 1e-9


@dataclass
class StepModel:
    """A decode step's duration against its batch size, fitted on measured steps."""

    sizes: list[tuple[int, int, float]]  #: (sequences decoding, steps measured, median ms), ascending
    intercept_ms: float  #: the fit's step time at zero sequences (ms)
    per_sequence_ms: float  #: what each further decoding sequence adds to a step (ms; 0 when flattened)
    flattened: bool  #: the least-squares slope came out negative and was taken as flat

    def ms(self, sequences: float) -> float:
        """The fitted duration of a decode step of ``sequences`` sequences (ms)."""
        return self.intercept_ms + self.per_sequence_ms * sequences

    def largest(self) -> int:
        """The largest batch measured."""
        return self.sizes[-1][0]

    def as_dict(self, at: int) -> dict:
        """The fit, what it rests on, and its use at a batch of ``at`` (``extrapolated``: beyond the
        largest batch measured)."""
        return {"intercept_ms": round(self.intercept_ms, 6), "per_sequence_ms": round(self.per_sequence_ms, 6),
                "flattened": self.flattened, "steps": sum(s for _, s, _ in self.sizes),
                "sizes": [{"decode_seqs": n, "steps": s, "median_ms": round(m, 6)} for n, s, m in self.sizes],
                "range": [self.sizes[0][0], self.largest()], "at": at, "step_ms_at": round(self.ms(at), 6),
                "extrapolated": at > self.largest()}


def decode_steps(steps: pl.DataFrame) -> pl.DataFrame:
    """The steps that decoded and prefilled nothing, with their duration in ms (``ms``)."""
    return steps.filter((pl.col("decode_seqs").fill_null(0) >= 1) & (pl.col("prefill_seqs").fill_null(0) == 0)
                        & pl.col("duration_ns").is_not_null()) \
        .select(pl.col("decode_seqs").cast(pl.Int64), (pl.col("duration_ns") / 1e6).alias("ms"))


def fit_steps(steps: pl.DataFrame) -> tuple[StepModel | None, str | None]:
    """The model fitted on an instance's steps (``steps_in`` rows), or None and why not."""
    decoding = decode_steps(steps)
    if decoding.is_empty():
        return None, "no decode step was measured in the window"
    sizes = [(int(n), len(group), float(median(group["ms"].to_list())))
             for (n,), group in sorted(decoding.group_by(["decode_seqs"]), key=lambda item: item[0][0])]
    if len(sizes) < 2:
        return None, (f"its {sizes[0][1]:,} decode steps in the window all ran {sizes[0][0]} sequence"
                      f"{'s' if sizes[0][0] != 1 else ''}, so how a larger batch slows a step was not measured")
    weight = sum(s for _, s, _ in sizes)
    mean_n = sum(n * s for n, s, _ in sizes) / weight
    mean_ms = sum(m * s for _, s, m in sizes) / weight
    slope = (sum(s * (n - mean_n) * (m - mean_ms) for n, s, m in sizes)
             / sum(s * (n - mean_n) ** 2 for n, s, _ in sizes))
    flattened = slope < 0
    slope = max(0.0, slope)
    model = StepModel(sizes, mean_ms - slope * mean_n, slope, flattened)
    if model.ms(sizes[0][0]) <= 0:
        return None, "the fit gives no positive step time at the smallest batch measured"
    return model, None


def decode_batches(steps: pl.DataFrame) -> tuple[dict[str, float], float | None]:
    """Per request, the mean number of sequences decoding in the steps it decoded in (every step that
    names it, ``decode_request_ids``); and that mean over all the instance's decoding steps (for the
    requests no step names)."""
    decoding = steps.filter(pl.col("decode_seqs").fill_null(0) >= 1)
    overall = None if decoding.is_empty() else float(decoding["decode_seqs"].mean())
    named = decoding.select("decode_seqs", "decode_request_ids").explode("decode_request_ids") \
        .drop_nulls("decode_request_ids")
    per = named.group_by("decode_request_ids").agg(pl.col("decode_seqs").mean())
    return dict(per.iter_rows()), overall


def batched_waits(arrivals: list[float], fixed: list[float], decode: list[float], measured_step_ms: list[float],
                  slots: int, step_ms) -> list[float]:
    """Waits (ms) of requests, first come first served over ``slots`` slots, where a request holds its
    slot for ``fixed`` ms (its prefill and the rest, unchanged) then decodes: its measured decode time
    ``decode`` ms, made at steps of ``measured_step_ms``, runs at steps of ``step_ms(k)`` while ``k``
    requests decode together, so it progresses at ``measured_step_ms / step_ms(k)`` of real time."""
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i])
    waits = [0.0] * len(arrivals)
    queue: deque[int] = deque()
    active: dict[int, list[float]] = {}  # request -> [fixed ms left, decode ms (measured) left]
    now, nxt = 0.0, 0
    while nxt < len(order) or queue or active:
        while nxt < len(order) and arrivals[order[nxt]] <= now:
            queue.append(order[nxt])
            nxt += 1
        for i in [i for i, (f, d) in active.items() if f <= _EPS_MS and d <= _EPS_MS]:
            del active[i]
        while queue and len(active) < slots:
            i = queue.popleft()
            waits[i] = now - arrivals[i]
            active[i] = [fixed[i], decode[i]]
        if any(f <= _EPS_MS and d <= _EPS_MS for f, d in active.values()):
            continue  # a request that holds no time leaves at once
        if not active:
            if nxt == len(order):
                break
            now = arrivals[order[nxt]]
            continue
        decoding = sum(1 for f, _ in active.values() if f <= _EPS_MS)
        rate = {i: measured_step_ms[i] / step_ms(decoding) for i, (f, _) in active.items() if f <= _EPS_MS}
        step = min(f if f > _EPS_MS else d / rate[i] for i, (f, d) in active.items())
        if nxt < len(order):
            step = min(step, arrivals[order[nxt]] - now)
        for i, left in active.items():
            if left[0] > _EPS_MS:
                left[0] = 0.0 if left[0] - step <= _EPS_MS else left[0] - step
            else:
                left[1] = 0.0 if left[1] - step * rate[i] <= _EPS_MS else left[1] - step * rate[i]
        now += step
    return waits
