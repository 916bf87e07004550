"""What tokentrace's own processes send each other besides OTLP (docs/collector.md, docs/engine.md)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

#: HTTP header on a POST /v1/traces whose body is a spool file's bytes (the engine shim's resends):
#: the file's name. The collector stores such a body once per SHA-256, as a file of its
#: --spool-dir, so a resend after a lost acknowledgement, or a file both resent and ingested from
#: the directory, is stored once.
SPOOL_FILE_HEADER = "X-Tokentrace-Spool-File"
#: What that header may hold: a plain file name.
SPOOL_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


def finite(value: Any) -> Any:
    """``value`` with NaN and infinities (a polars mean of nothing, a sender's NaN) as None: JSON has
    no NaN, and a page, twin, verdict or export must never fail on one (issue 11)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def dumps(data: Any, **options: Any) -> str:
    """Compact JSON of every tokentrace answer; NaN and infinities become null."""
    options = {"separators": (",", ":"), "allow_nan": False, **options}
    try:
        return json.dumps(data, **options)
    except ValueError:
        return json.dumps(finite(data), **options)
