"""The CLI: --help everywhere, bad arguments fail fast with one clear line and exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokentrace.cli import COMMANDS


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "tokentrace", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("command", [name for name, _, _ in COMMANDS])
def test_every_command_has_help(command):
    result = _run(command, "--help")
    assert result.returncode == 0, result.stderr
    assert f"usage: tokentrace {command}" in result.stdout


def test_top_level_help_lists_every_command():
    result = _run("--help")
    assert result.returncode == 0
    for name, _, _ in COMMANDS:
        assert name in result.stdout


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--port", "abc"], {}, "--port must be a TCP port between 1 and 65535, received 'abc'"),
    (["--port", "70000"], {}, "--port must be a TCP port between 1 and 65535, received '70000'"),
    ([], {"TOKENTRACE_PORT": "0"}, "TOKENTRACE_PORT must be a TCP port between 1 and 65535, received '0'"),
    (["--max-body-bytes", "-5"], {}, "--max-body-bytes must be a positive integer, received '-5'"),
    (["--token", "has space"], {}, "--token must be a non-empty token without spaces"),
    (["--db", "/nonexistent-dir/x.duckdb"], {}, "--db must be in an existing directory"),
    (["--log-level", "loud"], {}, "--log-level must be debug, info, warning or error, received 'loud'"),
])
def test_bad_collector_settings_exit_2_with_one_line(args, env, message):
    result = _run("collector", *args, env=env)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_command_exits_2():
    assert _run("frobnicate").returncode == 2
