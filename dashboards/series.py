"""Time series for the dashboard charts: fixed-width time buckets over a window.

Charts receive bucket starts as epoch milliseconds (what the browser's Date takes) and one value
per bucket; empty buckets are zeros for counts and None (a gap) for ratios.
"""

from __future__ import annotations

import polars as pl

#: Bucket widths in seconds, smallest first: a chart gets the smallest that keeps it under ``max_buckets``.
_STEPS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)


def span(since_ns: int | None, now_ns: int, times: list[pl.Series]) -> tuple[int, int]:
    """The stretch to chart: from the oldest time present (never before ``since``) to now.

    A cluster that started two minutes ago in a one-hour window gets two minutes of chart, not a
    sliver at the right edge; with no data at all it is the window (or the last minute)."""
    oldest = [s.min() for s in times if s.len() and s.min() is not None]
    if not oldest:
        return (since_ns if since_ns is not None else now_ns - 60_000_000_000), now_ns
    return max(min(oldest), since_ns or 0), now_ns


def step_ns(t0_ns: int, t1_ns: int, max_buckets: int = 60) -> int:
    """The bucket width for [t0, t1]."""
    length_s = max(1e-9, (t1_ns - t0_ns) / 1e9)
    for step in _STEPS_S:
        if length_s / step <= max_buckets:
            return step * 1_000_000_000
    return _STEPS_S[-1] * 1_000_000_000


def bucket_starts(t0_ns: int, t1_ns: int, width_ns: int) -> list[float]:
    """Epoch milliseconds of every bucket start in [t0, t1], aligned to the width."""
    first = t0_ns - t0_ns % width_ns
    return [b / 1e6 for b in range(first, t1_ns + 1, width_ns)]


def _index(frame: pl.DataFrame, column: str, t0_ns: int, width_ns: int) -> pl.DataFrame:
    first = t0_ns - t0_ns % width_ns
    return frame.with_columns(((pl.col(column) - first) // width_ns).alias("_bucket"))


def counts_by(frame: pl.DataFrame, column: str, key: str, t0_ns: int, t1_ns: int,
              width_ns: int) -> dict[str, list[int]]:
    """{key value: count per bucket} of the rows of ``frame`` by their time ``column``."""
    size = len(bucket_starts(t0_ns, t1_ns, width_ns))
    result: dict[str, list[int]] = {}
    if frame.height == 0:
        return result
    grouped = _index(frame, column, t0_ns, width_ns).group_by(key, "_bucket").len()
    for name, bucket, count in grouped.iter_rows():
        if 0 <= bucket < size:
            result.setdefault(str(name), [0] * size)[bucket] += count
    return dict(sorted(result.items()))


def ratio(frame: pl.DataFrame, column: str, numerator: str, denominator: str, t0_ns: int, t1_ns: int,
          width_ns: int) -> tuple[list[float | None], list[int]]:
    """sum(numerator) / sum(denominator) per bucket (None where the denominator is 0), and row counts."""
    size = len(bucket_starts(t0_ns, t1_ns, width_ns))
    values: list[float | None] = [None] * size
    rows = [0] * size
    if frame.height == 0:
        return values, rows
    grouped = _index(frame, column, t0_ns, width_ns).group_by("_bucket").agg(
        pl.col(numerator).fill_null(0).sum().alias("n"), pl.col(denominator).fill_null(0).sum().alias("d"),
        pl.len().alias("rows"))
    for bucket, n, d, count in grouped.iter_rows():
        if 0 <= bucket < size:
            values[bucket] = round(n / d, 4) if d else None
            rows[bucket] = count
    return values, rows
