"""Engine settings: one table, options over environment over defaults, bad values fail fast."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
from harness_collector import free_port

from tokentrace.engine_shim.mlx.settings import SETTINGS, add_setting_arguments, settings_from_args
from tokentrace.errors import ConfigError


def _parse(*argv: str, environ: dict | None = None):
    parser = argparse.ArgumentParser()
    add_setting_arguments(parser)
    return settings_from_args(parser.parse_args(list(argv)), environ or {})


def test_defaults_are_safe():
    settings = _parse("--model", "m")
    assert settings.host == "127.0.0.1" and settings.port == 8000
    assert settings.capture_content is False and settings.lazy_load is False
    assert settings.served_name == "m"


def test_option_beats_environment_beats_default():
    env = {"TOKENTRACE_ENGINE_MAX_BATCH": "3", "TOKENTRACE_ENGINE_MODEL": "/models/x/",
           "TOKENTRACE_ENGINE_LAZY_LOAD": "yes"}
    assert _parse(environ=env).max_batch == 3
    assert _parse("--max-batch", "5", environ=env).max_batch == 5
    assert _parse(environ=env).served_name == "x" and _parse(environ=env).lazy_load is True


@pytest.mark.parametrize(("argv", "env", "message"), [
    ([], {}, "--model is required"),
    (["--model", "m", "--max-batch", "0"], {}, "--max-batch must be an integer >= 1, received '0'"),
    (["--model", "m", "--port", "http"], {}, "--port must be an integer, received 'http'"),
    (["--model", "m"], {"TOKENTRACE_ENGINE_HEARTBEAT_INTERVAL": "fast"},
     "TOKENTRACE_ENGINE_HEARTBEAT_INTERVAL must be a number, received 'fast'"),
    (["--model", "m"], {"TOKENTRACE_ENGINE_CAPTURE_CONTENT": "maybe"},
     "TOKENTRACE_ENGINE_CAPTURE_CONTENT must be true or false, received 'maybe'"),
])
def test_bad_values_name_the_setting(argv, env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        _parse(*argv, environ=env)


def test_every_setting_has_an_option_and_an_env_var():
    assert len({s.option for s in SETTINGS}) == len(SETTINGS)
    assert all(s.env.startswith("TOKENTRACE_ENGINE_") for s in SETTINGS)


def test_cli_exits_2_with_one_line_on_a_bad_setting_and_1_when_the_model_cannot_load(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "tokentrace", "engine", *args], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "TOKENTRACE_ENGINE_MODEL": ""})

    bad = run("--model", "m", "--max-batch", "-1")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().endswith("--max-batch must be an integer >= 1, received '-1'")
    (tmp_path / "empty").mkdir()
    broken = run("--model", str(tmp_path / "empty"), "--port", str(free_port()), "--otlp-endpoint", "",
                 "--spool-dir", str(tmp_path / "spool"))
    assert broken.returncode == 1
    assert "has no config.json" in broken.stderr
