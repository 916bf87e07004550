"""The README's main command: `tokentrace demo --exit` runs the whole story and prints verdicts."""

from __future__ import annotations

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
    assert len(rows) >= len(SCENARIOS) + 1
    assert all(row.startswith("✓ ") for row in rows), out
    for category in ("cold_start", "queueing", "prefill", "decode"):
        assert any(f" {category} (" in row for row in rows), category
    for cause in ("capacity", "instance_change", "prefix_change", "new_prefix", "hit/none"):
        assert any(cause in row for row in rows), cause
    assert f"{len(rows)} of {len(rows)} verdicts as expected" in out
    assert "demo-long-gen-" in out and "demo-interloper" in out  # a blocker and the interleaved prefill
