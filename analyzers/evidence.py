"""Evidence items shared by every verdict: what a human reads, plus the numbers behind it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: The one word for "nothing to explain" (cache cause None) wherever a cause is counted or shown
#: (here, not in cache.py, so that rendering a fetched verdict needs no polars).
NO_CAUSE = "none"


@dataclass(frozen=True)
class Evidence:
    """One fact supporting a verdict.

    ``kind`` is a stable snake_case name tests and dashboards key on (e.g. ``blocker``,
    ``eviction``); ``text`` is one sentence for humans; ``data`` holds the numbers and ids;
    ``basis`` says whether an observer measured the fact or the analyzer inferred it (e.g. a
    capacity miss behind a gateway, where the engine reports no evictions).
    """

    kind: str  #: stable name of the fact
    text: str  #: one human sentence
    data: dict[str, Any] = field(default_factory=dict)  #: ids and numbers behind the sentence
    basis: str = "measured"  #: "measured" | "inferred"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: {kind, text, basis, **data}."""
        return {"kind": self.kind, "text": self.text, "basis": self.basis, **self.data}


def ms(ns: int | float | None) -> float | None:
    """Nanoseconds to milliseconds, rounded to 0.001 ms."""
    return None if ns is None else round(ns / 1e6, 3)


def fmt_ms(value: float | None) -> str:
    """A duration for humans: '12.3 ms', '4.56 s'."""
    if value is None:
        return "n/a"
    if abs(value) >= 1000:
        return f"{value / 1000:.2f} s"
    return f"{value:.1f} ms"


def median(values) -> float | None:
    """Median of the non-None values, or None when there are none."""
    clean = sorted(v for v in values if v is not None)
    if not clean:
        return None
    middle = len(clean) // 2
    return float(clean[middle]) if len(clean) % 2 else (clean[middle - 1] + clean[middle]) / 2
