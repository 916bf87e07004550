"""A request answered is a request recorded (issue 44, Deliver 2).

Each case answers a few requests, then stops the observer at once — SIGTERM to its whole process
group (what ``systemctl stop`` sends), SIGINT to the group (Ctrl-C), or SIGTERM to its main process
alone (the main process returns normally) — and asserts that every request id reaches the collector
and that ``tokentrace analyze slow --request-id`` answers it. Every process runs in a session of its
own (``start_new_session``), so that a signal to its group reaches it and its children only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from harness_collector import CollectorProcess, wait_for
from harness_engine import EngineProcess
from harness_gateway import GatewayProcess, MlxLmServer
from vllm_fixtures import MODEL, healthy, make_model, require_vllm_python, start_vllm
from vllm_fixtures import stop as vllm_stop

#: Requests answered before each stop: sequential and short, so that the last ones are answered
#: well within one export interval (500 ms) of the signal.
REQUESTS = 4
#: Seconds a stopped process may take to exit, a stuck collector included.
STOP_S = 40


class GroupEngine(EngineProcess):
    """``tokentrace engine`` in a session (process group) of its own."""

    def start(self, ready: bool = True, timeout: float = 120) -> GroupEngine:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tokentrace", "engine", *self.args],
                                         stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                         start_new_session=True)
        wait_for(lambda: self._health() == 200, timeout, f"engine on port {self.port} (log {self.log_path})")
        return self


class GroupGateway(GatewayProcess):
    """``tokentrace gateway`` in a session of its own."""

    def _spawn(self, cmd: list[str]) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                         start_new_session=True)


def signal_and_wait(proc: subprocess.Popen, sig: int, group: bool, log_path: Path) -> float:
    """Send ``sig`` to the process (its whole group with ``group``) and wait for it to exit; returns
    the seconds it took. A process still there after ``STOP_S`` fails the test."""
    started = time.monotonic()
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    try:
        proc.wait(STOP_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        pytest.fail(f"{log_path.name} did not stop within {STOP_S} s: {log_path.read_text()[-3000:]}")
    with_children_gone(proc.pid)
    return time.monotonic() - started


def with_children_gone(group: int) -> None:
    """Wait until nothing of the process group is left (the engine's exporter process included)."""
    def gone() -> bool:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(gone, STOP_S, f"every process of group {group} to exit")


def assert_recorded(collector: CollectorProcess, ids: list[str], timeout: float = 30) -> None:
    """Every id is in the store (the collector's API answers its verdict) and ``analyze slow
    --request-id`` prints a category for it."""
    def stored(rid: str) -> bool:
        response = httpx.get(f"{collector.url}/api/requests/{rid}/slow", headers=collector.headers, timeout=10)
        return response.status_code == 200

    deadline = time.monotonic() + timeout
    missing = list(ids)
    while missing and time.monotonic() < deadline:
        missing = [rid for rid in missing if not stored(rid)]
        if missing:
            time.sleep(0.2)
    assert not missing, f"answered but never recorded: {missing} of {ids}"
    for rid in ids:
        ran = subprocess.run([sys.executable, "-m", "tokentrace", "analyze", "slow", "--request-id", rid,
                              "--url", collector.url], capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0 and "category:" in ran.stdout, (rid, ran.stdout, ran.stderr)


def answer(url: str, prefix: str, count: int = REQUESTS, **fields) -> list[str]:
    """``count`` short chat requests, one after the other; returns their ids once all were answered."""
    ids = []
    with httpx.Client(timeout=120) as client:
        for i in range(count):
            rid = f"{prefix}-{i}"
            response = client.post(url + "/v1/chat/completions", headers={"X-Request-Id": rid},
                                   json={"messages": [{"role": "user", "content": f"hello {prefix} {i}"}],
                                         "max_tokens": 3, **fields})
            assert response.status_code == 200, response.text
            ids.append(rid)
    return ids


@pytest.fixture
def collector(tmp_path):
    process = CollectorProcess(tmp_path).start()
    yield process
    process.stop()


@pytest.fixture
def group_engine(tmp_path, tiny_model):
    made: list[GroupEngine] = []

    def make(collector: CollectorProcess | None, **kwargs) -> GroupEngine:
        engine = GroupEngine(tmp_path, tiny_model, collector=collector, **kwargs)
        made.append(engine)
        return engine.start()

    yield make
    for engine in made:
        if engine.proc is not None and engine.proc.poll() is None:
            os.killpg(engine.proc.pid, signal.SIGKILL)
            engine.proc.wait(10)


@pytest.mark.parametrize(("sig", "group"), [(signal.SIGTERM, True), (signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["sigterm-group", "sigint-group", "sigterm-main-process-normal-exit"])
def test_engine_records_every_request_answered_before_it_stops(collector, group_engine, sig, group):
    engine = group_engine(collector)
    ids = answer(engine.url, f"engine-{signal.Signals(sig).name.lower()}-{'group' if group else 'pid'}")
    signal_and_wait(engine.proc, sig, group, engine.log_path)
    assert engine.proc.returncode == 0, engine.log_path.read_text()[-3000:]
    assert_recorded(collector, ids)


@pytest.fixture
def mlx_lm_server(tmp_path, tiny_model):
    server = MlxLmServer(tmp_path, tiny_model).start()
    yield server
    server.stop()


@pytest.mark.parametrize(("sig", "group"), [(signal.SIGTERM, True), (signal.SIGINT, True)],
                         ids=["sigterm-group", "sigint-group"])
def test_gateway_records_every_request_answered_before_it_stops(tmp_path, collector, mlx_lm_server, sig, group):
    """mlx_lm.server reports nothing itself: the gateway's spans are the only record of a request."""
    gateway = GroupGateway(tmp_path, {"mlx": mlx_lm_server.url}, collector=collector).start()
    try:
        ids = answer(gateway.url, f"gateway-{signal.Signals(sig).name.lower()}")
        signal_and_wait(gateway.proc, sig, group, gateway.log_path)
    finally:
        gateway.stop()
    assert_recorded(collector, ids)
    assert gateway.proc.returncode == 0, gateway.log_path.read_text()[-3000:]


@pytest.fixture
def black_hole():
    """A collector that is stuck: it accepts connections (the kernel does) and never answers."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


@pytest.mark.parametrize("away", ["down", "stuck"])
def test_engine_spools_when_the_collector_is_away_at_stop_and_a_collector_ingests_it_later(
        tmp_path, group_engine, black_hole, away):
    """Down: the collector was stopped before the last requests. Stuck: it accepts connections and
    never answers, which must not hold the stop up (an export waits at most its timeout, then spools)."""
    first = CollectorProcess(tmp_path).start()
    engine = group_engine(first if away == "down" else SimpleNamespace(url=black_hole, token=None))
    ids = answer(engine.url, f"engine-{away}-1")
    first.stop()
    ids += answer(engine.url, f"engine-{away}-2")
    took = signal_and_wait(engine.proc, signal.SIGTERM, True, engine.log_path)
    assert engine.proc.returncode == 0 and took < STOP_S
    assert list(engine.spool_dir.glob("*.pb")), "nothing was spooled"
    later = CollectorProcess(tmp_path, "--spool-dir", str(engine.spool_dir), db=first.db).start()
    try:
        assert_recorded(later, ids)
    finally:
        later.stop()


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_plugin_records_every_request_answered_before_the_group_is_stopped(tmp_path, collector):
    """vLLM CPU with the plugin (.venv-vllm), stopped as ``systemctl stop`` stops it: SIGTERM to its
    process group, API server and engine core alike."""
    require_vllm_python()
    model = tmp_path / "tiny-llama"
    make_model(model)
    proc, url, log_path = start_vllm(model, collector.url, tmp_path)
    try:
        wait_for(lambda: healthy(proc, url, log_path), 300, f"vLLM /health (log {log_path})", interval=0.5)
        ids = answer(url, "vllm-sigterm-group", model=MODEL)
        signal_and_wait(proc, signal.SIGTERM, True, log_path)
    finally:
        vllm_stop(proc)
    assert_recorded(collector, ids)
