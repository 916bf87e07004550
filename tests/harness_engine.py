"""Real engine processes for tests: a generated model, free ports, real HTTP.

``tiny_model`` is written once per session by the real ``tokentrace make-model`` command.
``EngineProcess`` runs ``tokentrace engine`` as a subprocess; stopping it with SIGTERM flushes its
telemetry, so a collector has everything once ``stop()`` returns.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from harness_collector import CollectorProcess, free_port, wait_for

from tokentrace.engine_shim.mlx.jobs import Job, Sampling
from tokentrace.engine_shim.mlx.prompts import Prompt
from tokentrace.engine_shim.mlx.records import RequestRecord
from tokentrace.engine_shim.mlx.scheduler import LOAD_READY, Scheduler
from tokentrace.engine_shim.mlx.settings import EngineSettings


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random-weight model written by ``tokentrace make-model`` (once per session)."""
    directory = tmp_path_factory.mktemp("models") / "tiny"
    subprocess.run([sys.executable, "-m", "tokentrace", "make-model", str(directory), "--size", "tiny"],
                   check=True, capture_output=True, timeout=300)
    return directory


class EngineProcess:
    """One ``tokentrace engine`` subprocess on a free port."""

    def __init__(self, workdir: Path, model: Path, *args: str, collector: CollectorProcess | None = None,
                 instance_id: str = "engine-a", spool_dir: Path | None = None):
        self.workdir = Path(workdir)
        self.model = model
        self.port = free_port()
        self.instance_id = instance_id
        self.spool_dir = Path(spool_dir) if spool_dir else self.workdir / f"spool-{instance_id}"
        endpoint = collector.url if collector is not None else ""
        self.args = ["--model", str(model), "--port", str(self.port), "--instance-id", instance_id,
                     "--otlp-endpoint", endpoint, "--spool-dir", str(self.spool_dir), *args]
        if collector is not None and collector.token:
            self.args += ["--otlp-token", collector.token]
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / f"engine-{instance_id}-{self.port}.log"

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:PORT."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready: bool = True, timeout: float = 120) -> EngineProcess:
        """Start; wait for /health 200 (``ready``) or merely for the port to answer."""
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child process owns it
        self.proc = subprocess.Popen([sys.executable, "-m", "tokentrace", "engine", *self.args],
                                     stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        log.close()
        wanted = (200,) if ready else (200, 503)
        wait_for(lambda: self._health() in wanted, timeout, f"engine on port {self.port} (log {self.log_path})")
        return self

    def _health(self) -> int | None:
        if self.proc.poll() is not None:
            pytest.fail(f"engine exited with {self.proc.returncode}: {self.log_path.read_text()}")
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            return None

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM and wait (the engine flushes its spans before exiting); returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"engine did not stop within {timeout} s: {self.log_path.read_text()}")

    def post(self, path: str, body: dict | bytes, headers: dict | None = None, timeout: float = 120) -> httpx.Response:
        """POST a JSON body (or raw bytes) to the engine."""
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.url + path, content=content, timeout=timeout,
                          headers={"Content-Type": "application/json", **(headers or {})})

    def chat(self, messages: list[dict], headers: dict | None = None, **fields) -> httpx.Response:
        """POST /v1/chat/completions (not streamed)."""
        return self.post("/v1/chat/completions", {"messages": messages, **fields}, headers)

    def stream(self, path: str, body: dict, headers: dict | None = None) -> tuple[list[dict], httpx.Headers]:
        """POST with stream=true; returns the decoded SSE data objects (without [DONE]) and headers."""
        events = []
        with httpx.stream("POST", self.url + path, json={**body, "stream": True}, headers=headers or {},
                          timeout=120) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: "):]))
            return events, response.headers


def streamed_text(events: list[dict]) -> str:
    """The text of a streamed chat or completion answer."""
    parts = []
    for event in events:
        for choice in event.get("choices", []):
            parts.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return "".join(parts)


@pytest.fixture
def engine_factory(tmp_path, tiny_model):
    """Make engine processes on the tiny model; every one still running at the end is stopped."""
    made: list[EngineProcess] = []

    def make(*args: str, model: Path | None = None, **kwargs) -> EngineProcess:
        process = EngineProcess(tmp_path, model or tiny_model, *args, **kwargs)
        made.append(process)
        return process

    yield make
    for process in made:
        process.stop()


class SchedulerHarness:
    """The engine's scheduler in this process, on its own thread, plus what it delivered and emitted."""

    def __init__(self, model, **settings):
        self.finished: dict[str, str] = {}
        self.emitted: list = []
        self.done = threading.Condition()
        loaded = threading.Event()
        self.scheduler = Scheduler(EngineSettings(model=str(model), **settings), deliver=self._deliver,
                                   submit=self.emitted.append, on_load_done=lambda record: loaded.set())
        self.thread = threading.Thread(target=self.scheduler.run, daemon=True)
        self.thread.start()
        assert loaded.wait(60) and self.scheduler.load_state == LOAD_READY, "model did not load"

    def _deliver(self, items):
        with self.done:
            for job, _token, reason in items:
                if reason is not None:
                    self.finished[job.record.request_id] = reason
            self.done.notify_all()

    def submit(self, rid: str, tokens: list[int], max_tokens: int = 4) -> Job:
        record = RequestRecord(rid, "/test", time.perf_counter_ns())
        record.prompt = Prompt(tokens, ["prompt"], [0], [len(tokens)])
        job = Job(record=record, tokens=tokens, max_tokens=max_tokens, sampling=Sampling(ignore_eos=True))
        self.scheduler.submit(job)
        return job

    def wait(self, *rids: str) -> dict[str, str]:
        with self.done:
            assert self.done.wait_for(lambda: all(r in self.finished for r in rids), 60), self.finished
        return {r: self.finished[r] for r in rids}

    def stop(self):
        self.scheduler.stop()
        self.thread.join(30)
