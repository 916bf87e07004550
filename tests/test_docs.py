"""The docs promise what the code does: settings, commands and evidence kinds appear in both."""

from __future__ import annotations

import re
from pathlib import Path

from tokentrace.cli import COMMANDS
from tokentrace.collector.settings import SETTINGS
from tokentrace.dashboards.prometheus import SERIES

ROOT = Path(__file__).resolve().parents[1]


def _read(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def test_every_collector_setting_is_documented_with_its_option_and_variable():
    table = {tuple(re.findall(r"`([^`]+)`", line)[:2]) for line in _read("docs/collector.md").splitlines()
             if line.startswith("| `--")}
    settings = {("--" + s.name.replace("_", "-"), s.env) for s in SETTINGS}
    assert table == settings


def test_every_command_is_in_the_readme():
    readme = _read("README.md")
    for name, _, _ in COMMANDS:
        assert f"tokentrace {name}" in readme, name


def test_every_evidence_kind_is_documented():
    source = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "analyzers").glob("*.py"))
    kinds = set(re.findall(r'Evidence\(\s*"([a-z_]+)"', source))
    documented = set(re.findall(r"`([a-z_]+)`", _read("docs/analyzers.md")))
    assert kinds and kinds <= documented, kinds - documented


def test_every_metrics_series_is_documented_and_every_documented_one_is_served():
    """docs/metrics.md's series tables name exactly the series /metrics prints (``SERIES``; a counter
    as printed, with ``_total``): a series added or renamed in code without a row fails here."""
    documented = {re.sub(r"\{.*", "", name) for line in _read("docs/metrics.md").splitlines()
                  if line.startswith("| `") for name in re.findall(r"`([^`]+)`", line.split("|")[1])}
    printed = {name + "_total" if kind == "counter" else name for name, (kind, _) in SERIES.items()}
    assert printed - documented == set(), "served but not in docs/metrics.md"
    assert documented - printed == set(), "in docs/metrics.md's series tables but not served"
