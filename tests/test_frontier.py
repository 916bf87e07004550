"""collector/stores/frontier.c's memory of recent block keys (issue 45): ``RecentKeys.fresh`` with more
distinct keys in one call than a generation has slots looped forever, holding the GIL, once its
open-addressing table was full. Each case runs in a child process under a deadline, so that a
regression fails here instead of hanging the suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

DEADLINE_S = 60


def _run(code: str) -> str:
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                              timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"RecentKeys did not return within {DEADLINE_S} s (a probe of a full table never ends)")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize(("capacity", "keys"), [(1, 100), (8, 10_000), (1000, 5_000)])
def test_fresh_ends_when_one_call_brings_more_keys_than_a_generation_holds(capacity, keys):
    out = _run(f"""
        import numpy as np
        from tokentrace.collector.stores.frontier import RecentKeys
        recent = RecentKeys({capacity})
        keys = np.arange(1, {keys} + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        first = recent.fresh(keys)
        again = recent.fresh(keys)
        print(int(first.sum()), bool(again[-1]), bool(again[0]), int(again.sum()))
    """)
    first, last_fresh, first_fresh, again = out.split()
    assert int(first) == keys  # nothing was recorded before the call: every key is new
    assert last_fresh == "False"  # the call's last keys are remembered ...
    assert first_fresh == "True"  # ... its first ones were dropped with a generation
    assert int(again) >= keys - 2 * capacity  # at most two generations remembered


def test_frontiers_and_fresh_agree_on_many_keys_in_small_generations():
    """``frontiers`` already rotated per key; ``fresh`` now keeps the same memory of recent keys."""
    out = _run("""
        import numpy as np
        from tokentrace.collector.stores.frontier import RecentKeys
        a, b = RecentKeys(4), RecentKeys(4)
        keys = np.arange(1, 50, dtype=np.uint64)
        a.fresh(keys)
        print(a.fresh(keys[-3:]).tolist(), a.fresh(keys[:3]).tolist())
    """)
    assert out == "[False, False, False] [True, True, True]"
