"""docs/engine.md documents every engine setting, endpoint and exported API name (STYLE §19)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokentrace.engine_shim import __all__ as exported
from tokentrace.engine_shim.mlx.settings import SETTINGS

DOC = (Path(__file__).parents[1] / "docs" / "engine.md").read_text()


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.option for s in SETTINGS])
def test_every_setting_is_documented_with_its_env_var(setting):
    assert f"| `--{setting.option}` | `{setting.env}` |" in DOC


def test_every_documented_option_exists():
    documented = {line.split("`")[1] for line in DOC.splitlines() if line.startswith("| `--")}
    assert documented == {f"--{s.option}" for s in SETTINGS}


@pytest.mark.parametrize("route", ["POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models",
                                   "GET /v1/models/{id}", "GET /health"])
def test_every_route_is_documented(route):
    assert f"`{route}`" in DOC


def test_the_api_names_in_the_example_are_exported():
    for name in ("Instrumentation", "build_chat_prompt", "engine_resource"):
        assert name in exported and name in DOC
