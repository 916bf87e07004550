"""Real llama.cpp ``llama-server`` processes on the tiny model's GGUF (``make-model --gguf``).

The binary comes from ``TOKENTRACE_LLAMA_SERVER`` (tests/run sets it) or from ``tests/setup_llama.sh``,
which builds it once from the llama-cpp-python sdist and caches it (seconds when cached). Each server
binds 127.0.0.1 on a free port and runs on one thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import httpx
import pytest
from harness_collector import free_port, terminate, wait_for

ROOT = Path(__file__).resolve().parents[1]


@cache
def llama_server_binary() -> str:
    """Path of a working llama-server."""
    given = os.environ.get("TOKENTRACE_LLAMA_SERVER")
    if given:
        return given
    result = subprocess.run(["bash", str(ROOT / "tests" / "setup_llama.sh")], capture_output=True, text=True,
                            timeout=3600)
    assert result.returncode == 0, f"tests/setup_llama.sh failed:\n{result.stderr[-3000:]}"
    return result.stdout.strip().splitlines()[-1]


class LlamaServer:
    """One ``llama-server`` on the GGUF at ``model``; ``args`` go to its command line."""

    def __init__(self, workdir: Path, model: Path, *args: str):
        self.port = free_port()
        self.log_path = workdir / f"llama-server-{self.port}.log"
        self.cmd = [llama_server_binary(), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                    "-t", "1", "--metrics", "--slots", *args]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> LlamaServer:
        """Start and wait until ``/health`` answers 200 (503 while it loads)."""
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)

        def healthy() -> bool:
            assert self.proc.poll() is None, f"llama-server exited: {self.log_path.read_text()[-2000:]}"
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, timeout, f"llama-server on {self.port} (log {self.log_path})")
        return self

    def stop(self) -> None:
        terminate(self.proc)
        if self.proc is not None:
            self._log.close()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """The tiny model with its GGUF beside it (make-model --gguf)."""
    directory = tmp_path_factory.mktemp("tiny-gguf") / "tiny"
    result = subprocess.run([sys.executable, "-m", "tokentrace", "make-model", str(directory), "--gguf"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return directory


@pytest.fixture
def llama_factory(tmp_path):
    """Make llama-server processes; all are stopped at the end."""
    made: list[LlamaServer] = []

    def make(model: Path, *args: str) -> LlamaServer:
        server = LlamaServer(tmp_path, model, *args)
        made.append(server)
        return server.start()

    yield make
    for server in made:
        server.stop()
