"""Startup errors say the one thing that is wrong (issue 12 §4): a busy port, a model path that does
not exist, an mlx_lm.server option we do not support, a bind beyond loopback without an API key."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from harness_collector import free_port


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokentrace", *args], capture_output=True, text=True,
                          timeout=timeout, env={k: v for k, v in os.environ.items() if not k.startswith("TOKENTRACE_")})


@pytest.fixture
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_engine_on_a_busy_port_says_so_in_one_line(tmp_path, tiny_model, busy_port):
    result = _run("engine", "--model", str(tiny_model), "--port", str(busy_port), "--otlp-endpoint", "",
                  "--spool-dir", str(tmp_path / "spool"))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"--port {busy_port}" in lines[0] and "in use" in lines[0]
    assert "serving" not in result.stderr and "Traceback" not in result.stderr


def test_collector_on_a_busy_port_creates_no_store(tmp_path, busy_port):
    db = tmp_path / "store.duckdb"
    result = _run("collector", "--port", str(busy_port), "--db", str(db))
    assert result.returncode != 0
    assert f"--port {busy_port}" in result.stderr and "in use" in result.stderr
    assert "Traceback" not in result.stderr
    assert not db.exists()


@pytest.mark.parametrize("model", ["./no/such/model", "/no/such/model", "~/no-such-model-dir"])
def test_a_model_path_that_does_not_exist_is_named_without_a_hub_attempt(tmp_path, model):
    result = _run("engine", "--model", model, "--port", str(free_port()), "--otlp-endpoint", "",
                  "--spool-dir", str(tmp_path / "spool"), timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"tokentrace engine: error: --model {model}: no such model directory"]


@pytest.mark.parametrize(("option", "names"), [
    (["--draft-model", "x"], "speculative decoding"),
    (["--kv-bits", "4"], "KV-cache quantization"),
])
def test_refused_mlx_lm_server_options_say_why_and_what_instead(tmp_path, tiny_model, option, names):
    result = _run("engine", "--model", str(tiny_model), *option, "--otlp-endpoint", "", timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0] and "tokentrace" in lines[0], result.stderr


def test_a_bind_beyond_loopback_needs_an_api_key_or_the_insecure_flag(tmp_path, tiny_model):
    result = _run("engine", "--model", str(tiny_model), "--host", "0.0.0.0", "--otlp-endpoint", "", timeout=60)
    assert result.returncode == 2
    assert "--api-key" in result.stderr and "--insecure-no-api-key" in result.stderr
