"""The README's main command: `tokentrace demo --exit` runs the whole story and prints verdicts."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tokentrace.demo_workload import SCENARIOS

pytestmark = pytest.mark.slow


def test_demo_prints_every_scenario_with_the_expected_verdict(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tokentrace", "demo", "--exit", "--workdir", str(tmp_path),
                             "--port", "0"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    rows = [line for line in out.splitlines() if line[:2] in ("✓ ", "✗ ")]
    assert len(rows) >= len(SCENARIOS)
    check_table(out)
    assert all(row.startswith("✓ ") for row in rows), out
    for category in ("cold_start", "queueing", "prefill", "decode"):
        assert any(f" {category} (" in row for row in rows), category
    for cause in ("capacity", "instance_change", "prefix_change", "new_prefix", "hit/none"):
        assert any(cause in row for row in rows), cause
    assert re.search(rf"(\d+) of \1 verdicts as expected \({len(rows)} requests\)", out), out
    assert "demo-long-gen-" in out and "demo-interloper" in out  # a blocker and the interleaved prefill
    # Then what to change: the advice over the demo's traffic, as analyze advise ranks it.
    advice = out.split("what would have saved the most (analyze advise):\n", 1)[1].split("\ndashboard:", 1)[0]
    lines = advice.splitlines()
    assert lines and lines[0].startswith("  1. ") and len(lines) <= 3, advice
    assert any("concurrency" in line or "cold starts" in line for line in lines), advice


def check_table(out: str) -> None:
    """Issue 15's complaints about the table: one row per request, evidence cut only at a word
    (with an ellipsis), the abnormal column explained."""
    rows = [line for line in out.splitlines() if line[:2] in ("✓ ", "✗ ")]
    header = next(line for line in out.splitlines() if "scenario" in line and "evidence" in line)
    at, column = header.index("evidence"), header.index("request")
    ids = [row[column:].split()[0] for row in rows]
    assert all(rid.startswith("demo-") for rid in ids), ids
    assert len(ids) == len(set(ids)), ids
    for row in rows:
        evidence = row[at:]
        # Evidence is whole sentences; a shortened one ends at a word with an ellipsis.
        assert evidence.endswith((".", " …")) and len(evidence) <= 110, row
    assert "(?)" not in out
    assert "abnormal?" in out and "n/a when fewer than 3 comparable requests" in out
