"""docs/truth.md's table is what the truth matrix runs: every situation it describes has a row, every
path a column and a test module, every declaration that is not a plain ``yes`` a reason."""

from __future__ import annotations

import re
from pathlib import Path

from matrix import CELLS, DOC, PATHS, SITUATIONS, described_situations

HERE = Path(__file__).resolve().parent


def test_every_described_situation_has_a_row_and_every_row_a_description():
    assert described_situations() == SITUATIONS
    assert len(SITUATIONS) == len(set(SITUATIONS)) >= 19


def test_every_cell_is_declared_and_every_reason_given():
    assert set(CELLS) == {(path, situation) for path in PATHS for situation in SITUATIONS}
    for (path, situation), declaration in CELLS.items():
        if declaration.kind != "yes":
            assert declaration.reason and declaration.reason.endswith("."), (path, situation, declaration)


def test_every_reason_is_used():
    text = DOC.read_text(encoding="utf-8")
    given = set(re.findall(r"^- \[([a-z-]+)\]: ", text, re.M))
    used = set(re.findall(r"\| [^|]*?\[([a-z-]+)\] ", text))
    assert given == used, (given - used, used - given)


def test_every_path_runs_in_a_test_module():
    source = "".join(path.read_text(encoding="utf-8") for path in HERE.glob("test_truth_*.py"))
    for path in PATHS:
        assert f'"{path}"' in source, path
