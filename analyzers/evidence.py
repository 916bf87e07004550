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


def fmt_bytes(value: float | None) -> str:
    """1536 -> '1.5 KiB'; None -> 'n/a'."""
    if value is None:
        return "n/a"
    if abs(value) < 1024:
        return f"{value:.0f} B"
    for unit in ("KiB", "MiB"):
        value /= 1024
        if abs(value) < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} GiB"


def plural(count: int | float | None, one: str, many: str | None = None) -> str:
    """'1 request', '3 requests', 'an unknown number of requests': a count and its noun, agreeing."""
    many = many or one + "s"
    if count is None:
        return f"an unknown number of {many}"
    return f"{count} {one if count == 1 else many}"


#: What each baseline metric (analyzers/slowness.py) is called in a sentence: never its field name.
MEASURE_NAMES = {"queue_ms": "queue", "load_wait_ms": "load wait", "tpot_ms": "time per output token",
                 "prefill_ms_per_uncached_token": "prefill per uncached token"}


def fmt_measure(value: float | None, unit: str) -> str:
    """A measure with its unit and a precision that suits it: '5.63 s', '0.242 ms', '0.0183 ms/token'."""
    if value is None:
        return "n/a"
    if unit == "ms":
        return fmt_ms(value) if abs(value) >= 10 else f"{value:.3g} ms"
    return f"{value:.3g} {unit}"


def baseline_text(base: dict) -> str:
    """One sentence for a slowness verdict's baseline: 'queue 5.63 s against a median of 0.242 ms over
    12 comparable requests.'"""
    if not base:
        return "not judged"
    name = MEASURE_NAMES.get(base["metric"], base["metric"].replace("_", " "))
    over = plural(base["samples"], "comparable request")
    if base.get("value") is None:
        return f"{name} {fmt_measure(base['observed'], base['unit'])}; no baseline yet ({over})."
    return (f"{name} {fmt_measure(base['observed'], base['unit'])} against a median of "
            f"{fmt_measure(base['value'], base['unit'])} over {over}.")


def median(values) -> float | None:
    """Median of the non-None values, or None when there are none."""
    clean = sorted(v for v in values if v is not None)
    if not clean:
        return None
    middle = len(clean) // 2
    return float(clean[middle]) if len(clean) % 2 else (clean[middle - 1] + clean[middle]) / 2
