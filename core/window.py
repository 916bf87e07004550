"""Time windows from human durations: ``--since 15m``, ``?since=1h``."""

from __future__ import annotations

import datetime
import re
import time
from dataclasses import dataclass

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


def parse_time(text: str, what: str) -> int:
    """An absolute time -> epoch nanoseconds: ISO 8601 ('2026-12-05T20:00:00Z', '2026-12-05 20:00:00+01:00';
    without an offset it is UTC, the store's clock) or epoch seconds ('1764964800.5'). ConfigError
    naming ``what`` otherwise."""
    value = (text or "").strip()
    if re.fullmatch(r"\d{9,11}(\.\d+)?", value):
        return round(float(value) * 1e9)
    try:
        moment = datetime.datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ConfigError(f"{what} must be a time such as 2026-12-05T20:00:00Z (ISO 8601; UTC without an offset) "
                          f"or epoch seconds, received {_shown(text)}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return int(moment.timestamp()) * 1_000_000_000 + moment.microsecond * 1000


def window_ns(since: str | None, start: str | None, until: str | None, default_since: str | None = None,
              now_ns: int | None = None, names: tuple[str, str, str] = ("--since", "--from", "--until"),
              ) -> tuple[int | None, int | None]:
    """[since_ns, until_ns) of a window given as ``since`` (relative, ending now) or ``start`` and
    ``until`` (absolute; either may be left open); ``names`` are what the caller calls the three (the
    CLI's options, the API's query parameters). ConfigError when both kinds are given or the window
    is empty."""
    name_since, name_from, name_until = names
    if since is not None and (start is not None or until is not None):
        raise ConfigError(f"give {name_since} (a window ending now) or {name_from}/{name_until} (absolute "
                          "times), not both")
    if start is None and until is None:
        return since_ns(since if since is not None else default_since, now_ns, what=name_since), None
    first = parse_time(start, name_from) if start is not None else None
    last = parse_time(until, name_until) if until is not None else None
    if first is not None and last is not None and last <= first:
        raise ConfigError(f"{name_until} ({until}) must be after {name_from} ({start})")
    return first, last


@dataclass(frozen=True)
class Slice:
    """The requests of a report, advice or replay beyond its window: one instance, model, session or
    request-id prefix (None: any). The named queries take these as parameters."""

    instance_id: str | None = None
    model: str | None = None
    session_id: str | None = None
    request_prefix: str | None = None

    def params(self) -> dict[str, str | None]:
        return {"instance_id": self.instance_id, "model": self.model, "session_id": self.session_id,
                "request_prefix": self.request_prefix}

    def __bool__(self) -> bool:
        return any(value is not None for value in self.params().values())

    def keep(self, frame):
        """The rows of a requests frame (polars) in the slice beyond its instance (the store's query
        chooses the instance): model, session and request-id prefix."""
        import polars as pl

        for column, value in (("model", self.model), ("session_id", self.session_id)):
            if value is not None:
                frame = frame.filter(pl.col(column) == value)
        if self.request_prefix is not None:
            frame = frame.filter(pl.col("request_id").str.starts_with(self.request_prefix))
        return frame
