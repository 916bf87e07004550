"""Prometheus text exposition (format 0.0.4), read by the adapters of engines that serve ``/metrics``
(llama.cpp, SGLang): each series summed over its label sets."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", re.MULTILINE)


def parse_samples(text: str, prefix: str) -> dict[str, float]:
    """{metric name: value summed over label sets} of the samples whose name starts with ``prefix``;
    comments and values that are not numbers are skipped."""
    values: dict[str, float] = {}
    for name, _labels, raw in _SAMPLE.findall(text):
        if not name.startswith(prefix):
            continue
        try:
            value = float(raw)
        except ValueError:
            continue
        if value == value:  # NaN says nothing
            values[name] = values.get(name, 0.0) + value
    return values
