"""docs/gateway.md documents every gateway setting, route, policy and adapter kind (STYLE §19)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokentrace import contract as c
from tokentrace.engine_shim.gateway.adapters import kinds
from tokentrace.engine_shim.gateway.settings import SETTINGS

DOC = (Path(__file__).parents[1] / "docs" / "gateway.md").read_text()


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.option for s in SETTINGS])
def test_every_setting_is_documented_with_its_env_var(setting):
    assert f"| `--{setting.option}` | `{setting.env}` |" in DOC


def test_every_documented_option_exists():
    documented = {line.split("`")[1] for line in DOC.splitlines() if line.startswith("| `--")}
    assert documented == {f"--{s.option}" for s in SETTINGS}


@pytest.mark.parametrize("name", [*c.ENUMS[c.ROUTE_POLICY], *kinds(), "POST /v1/chat/completions",
                                  "POST /v1/completions", "GET /v1/models", "GET /v1/models/{id}",
                                  "GET /health"])
def test_policies_adapter_kinds_and_routes_are_documented(name):
    assert f"`{name}`" in DOC
