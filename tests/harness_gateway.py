"""Real upstreams and a real gateway for tests: mlx-lm's own server (``python -m mlx_lm.server``, an
engine nobody here wrote) on the generated tiny model, and ``tokentrace gateway`` in front of it, as
subprocesses on free ports. Stopping the gateway with SIGTERM exports everything it observed.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from harness_collector import CollectorProcess, free_port, wait_for


class Process:
    """A subprocess with a log file and a port."""

    def __init__(self, workdir: Path, label: str):
        self.workdir = Path(workdir)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / f"{label}-{self.port}.log"
        self.headers: dict[str, str] = {}  #: sent with health checks (a gateway with --api-key)

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:PORT."""
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, cmd: list[str]) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child process owns it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        log.close()

    def _status(self, path: str) -> int | None:
        if self.proc.poll() is not None:
            pytest.fail(f"{self.log_path.name} exited with {self.proc.returncode}: {self.log_path.read_text()[-3000:]}")
        try:
            return httpx.get(self.url + path, headers=self.headers, timeout=2).status_code
        except httpx.HTTPError:
            return None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal and wait; returns the exit code."""
        if hasattr(self, "client"):
            self.client.close()
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            pytest.fail(f"{self.log_path.name} did not stop within {timeout} s after signal {sig}")

    def kill(self) -> None:
        """kill -9."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


class MlxLmServer(Process):
    """``python -m mlx_lm.server --model DIR --port P [args]``."""

    def __init__(self, workdir: Path, model: Path, *args: str):
        super().__init__(workdir, "mlx_lm.server")
        self.cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(self.port), *args]

    def start(self, timeout: float = 120) -> MlxLmServer:
        """Start and wait for /health 200."""
        self._spawn(self.cmd)
        wait_for(lambda: self._status("/health") == 200, timeout, f"mlx_lm.server on {self.port}")
        return self


class GatewayProcess(Process):
    """``tokentrace gateway`` in front of named upstreams, reporting to a collector."""

    def __init__(self, workdir: Path, upstreams: dict[str, str], *args: str,
                 collector: CollectorProcess | None = None):
        super().__init__(workdir, "gateway")
        # One client, made before any timing: building an httpx client loads an SSL context, which
        # costs far more than the whole hop being measured.
        self.client = httpx.Client(timeout=120)
        self.cmd = [sys.executable, "-m", "tokentrace", "gateway", "--port", str(self.port),
                    "--otlp-endpoint", collector.url if collector else "", "--poll-interval", "0.5",
                    "--spool-dir", str(self.workdir / f"spool-gateway-{self.port}"), "--log-level", "warning"]
        for name, url in upstreams.items():
            self.cmd += ["--upstream", f"{name}={url}"]
        self.cmd += list(args)
        if "--api-key" in args:
            self.headers = {"Authorization": f"Bearer {args[list(args).index('--api-key') + 1]}"}

    def start(self, timeout: float = 120) -> GatewayProcess:
        """Start and wait until /health says an upstream is usable."""
        self._spawn(self.cmd)
        wait_for(lambda: self._status("/health") == 200 and self.health()["status"] == "ok", timeout,
                 f"gateway on {self.port} (log {self.log_path})")
        return self

    def health(self) -> dict:
        """The gateway's /health body."""
        return httpx.get(self.url + "/health", headers=self.headers, timeout=10).json()

    def chat(self, messages: list[dict], request_id: str, session: str | None = None, stream: bool = True,
             max_tokens: int = 8, **fields) -> dict:
        """One chat request; returns what the client saw: status, headers, text, usage, and the
        client's own TTFT (first content chunk) and e2e in ms."""
        headers = {"X-Request-Id": request_id, **({"X-Session-Id": session} if session else {})}
        body = {"model": "default_model", "messages": messages, "max_tokens": max_tokens, "stream": stream, **fields}
        start = time.perf_counter()
        if not stream:
            response = self.client.post(self.url + "/v1/chat/completions", json=body, headers=headers)
            payload = response.json()
            text = payload["choices"][0]["message"]["content"] if response.status_code == 200 else ""
            return {"status": response.status_code, "headers": response.headers, "text": text,
                    "usage": payload.get("usage"), "body": payload, "e2e_ms": (time.perf_counter() - start) * 1e3}
        text, usage, first, events = "", None, None, []
        with self.client.stream("POST", self.url + "/v1/chat/completions", json=body, headers=headers) as response:
            for line in response.iter_lines():
                event = _event(line)
                if event is None:
                    continue
                events.append(event)
                usage = event.get("usage") or usage
                piece = _content(event)
                if piece:
                    text += piece
                    if first is None:
                        first = (time.perf_counter() - start) * 1e3
        return {"status": response.status_code, "headers": response.headers, "text": text, "usage": usage,
                "events": events, "ttft_ms": first, "e2e_ms": (time.perf_counter() - start) * 1e3}

    def burst(self, chats: list[tuple[list[dict], str, dict]]) -> list[dict]:
        """Streamed chats, given as (messages, request id, body fields), that reach the gateway
        together: every connection is opened first, then the gateway is stopped (SIGSTOP) while each
        request is written whole, and resumed (SIGCONT) once all wait in its sockets, so that it reads
        them in one turn of its event loop, in the order written, whatever the host does to the writer
        or to the gateway meanwhile. Written back to back without the stop, they were once read a whole
        answer apart: on this 2-core host vLLM CPU's spinning threads keep every other process off the
        CPU while it generates (a separate 5 ms sleeper measured 523 ms lags), and the writer or the
        gateway was frozen between two requests (the last stop's CI; 2 of 22 runs here). Their answers
        are read after, in order; returns each one's status, text and events."""
        ready = []
        for messages, request_id, fields in chats:
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            connection.connect()
            body = json.dumps({"model": "default_model", "messages": messages, "stream": True, **fields}).encode()
            ready.append((connection, body, {"X-Request-Id": request_id, "Content-Type": "application/json",
                                             **self.headers}))
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: _state(self.proc.pid) == "T", 10, f"the gateway {self.proc.pid} stopped", interval=0.001)
            for connection, body, headers in ready:
                connection.request("POST", "/v1/chat/completions", body=body, headers=headers)
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)
        answers = []
        for connection, _, _ in ready:
            response = connection.getresponse()
            events = [e for e in map(_event, response.read().decode().splitlines()) if e is not None]
            connection.close()
            answers.append({"status": response.status, "text": "".join(filter(None, map(_content, events))),
                            "events": events})
        return answers


def _state(pid: int) -> str:
    """A process's state letter from /proc (``T``: stopped by a signal)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def _event(line: str) -> dict | None:
    """The JSON of one SSE ``data:`` line; None for any other line and for ``[DONE]``."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line[6:])


def _content(event: dict) -> str:
    """The content an OpenAI chat chunk carries."""
    return "".join((choice.get("delta") or {}).get("content") or "" for choice in event.get("choices") or ())


def verdict(collector: CollectorProcess, request_id: str, timeout: float = 30) -> dict:
    """Both verdicts of a request from the collector's API, once its row is stored."""
    def fetch():
        response = httpx.get(f"{collector.url}/api/requests/{request_id}/verdict", headers=collector.headers,
                             timeout=30)
        return response.json() if response.status_code == 200 else None

    return wait_for(fetch, timeout, f"the verdict of {request_id}", interval=0.2)
