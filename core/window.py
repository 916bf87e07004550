"""Time windows from human durations: ``--since 15m``, ``?since=1h``."""

from __future__ import annotations

import re
import time

from tokentrace.errors import ConfigError

_UNITS = {"ms": 1_000_000, "s": 1_000_000_000, "m": 60_000_000_000, "h": 3_600_000_000_000,
          "d": 86_400_000_000_000}
#: Longest window: a longer one is 'all', and beyond ~292 years nanoseconds leave 64 bits.
MAX_DURATION_NS = 100 * 365 * _UNITS["d"]
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")


def parse_duration(text: str, what: str = "--since") -> int:
    """'15m' -> nanoseconds; ConfigError naming ``what`` when it is not a duration."""
    match = _DURATION.match(text or "") if len(text or "") <= 40 else None
    if not match:
        raise ConfigError(f"{what} must be a duration such as 30s, 15m, 1h or 2d, received {_shown(text)}")
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if not value <= MAX_DURATION_NS:  # also catches inf from 400 digits
        raise ConfigError(f"{what} must be at most 100 years (or 'all'), received {_shown(text)}")
    return int(value)


def _shown(text: str | None) -> str:
    return repr(text) if text is None or len(text) <= 40 else repr(text[:37] + "...")


def since_ns(text: str | None, now_ns: int | None = None, what: str = "--since") -> int | None:
    """The start of a window ending now, or None (everything) when ``text`` is empty or 'all'."""
    if text is None or text.strip().lower() in ("", "all"):
        return None
    return (now_ns if now_ns is not None else time.time_ns()) - parse_duration(text, what)
