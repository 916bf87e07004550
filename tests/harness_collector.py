"""Real collector processes for tests: free ports, real DuckDB files, real HTTP.

DuckDB lets one process hold a file for writing, so SQL on the file runs after the collector
stopped (``CollectorProcess.sql``), exactly as a user would query a stopped collector's store.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import httpx
import pytest


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate`` until it returns a truthy value; fail the test with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def proc_status(pid: int, field: str) -> int:
    """A memory figure of a process from /proc/PID/status, in bytes (``VmRSS``; ``VmHWM``: the most
    resident memory it ever had)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def terminate(proc: subprocess.Popen | None, timeout: float = 30) -> None:
    """SIGTERM a helper process (a third-party server) and wait; SIGKILL when it does not stop."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


class CollectorProcess:
    """One ``tokentrace collector`` subprocess on a free port."""

    def __init__(self, workdir: Path, *args: str, db: Path | None = None, token: str | None = None,
                 store: str | None = None, env: dict[str, str] | None = None):
        self.workdir = Path(workdir)
        self.env = env  #: the subprocess's environment (None: this process's)
        self.db = Path(db) if db else self.workdir / "store.duckdb"
        self.store = store  #: a --store URL, used instead of --db when set
        self.args = list(args)
        self.token = token
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / f"collector-{self.port}.log"

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:PORT."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict:
        """The auth header when a token is set."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def start(self, timeout: float = 60) -> CollectorProcess:
        """Start and wait until /healthz answers 200."""
        where = ["--store", self.store] if self.store else ["--db", str(self.db)]
        cmd = [sys.executable, "-m", "tokentrace", "collector", *where, "--port", str(self.port),
               "--log-level", "warning", *self.args]
        if self.token:
            cmd += ["--token", self.token]
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child process owns it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir, env=self.env)
        log.close()
        wait_for(self._healthy, timeout, f"collector on port {self.port} (log {self.log_path})")
        return self

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"collector exited with {self.proc.returncode}: {self.log_path.read_text()}")
        try:
            return httpx.get(self.url + "/healthz", headers=self.headers, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def health(self) -> dict:
        """The /healthz body."""
        return httpx.get(self.url + "/healthz", headers=self.headers, timeout=10).json()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal the process and wait for it; returns its exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"collector did not stop within {timeout} s after signal {sig}")

    def kill(self) -> None:
        """kill -9: no shutdown of any kind."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def sql(self, query: str, params: list | None = None) -> list[tuple]:
        """Run SQL on the store file; the collector must be stopped."""
        assert self.proc is None or self.proc.poll() is not None, "stop the collector before reading its file"
        con = duckdb.connect(str(self.db), read_only=True)
        try:
            return con.execute(query, params or []).fetchall()
        finally:
            con.close()

    def post(self, body: bytes, content_type: str, **headers) -> httpx.Response:
        """POST /v1/traces with a raw body."""
        all_headers = {"Content-Type": content_type, **self.headers, **headers}
        return httpx.post(self.url + "/v1/traces", content=body, headers=all_headers, timeout=30)


@pytest.fixture
def collector_factory(tmp_path):
    """Make collector processes; every one still running at the end is stopped."""
    made: list[CollectorProcess] = []

    def make(*args: str, **kwargs) -> CollectorProcess:
        process = CollectorProcess(tmp_path, *args, **kwargs)
        made.append(process)
        return process

    yield make
    for process in made:
        process.stop()
