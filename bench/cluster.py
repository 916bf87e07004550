"""What does a distributed tokentrace engine cost? Two ranks on the ring, servers side by side.

Servers on one generated qwen2 model, each two ranks over MLX's ring backend on 127.0.0.1, pipeline
placement (issue 46's acceptance); ``--servers`` picks them:

* ``telemetry``: ``tokentrace engine --ranks 2 --parallel pipeline``, spans exported to a sink
  process (an HTTP server that reads and drops them), steps timed as by default (one in 8 at most
  each 0.25 s, and the first of each request's prefill and decode);
* ``dropped``: the same engine with its records thrown away before the telemetry thread
  (``TOKENTRACE_ENGINE_TELEMETRY=drop``) and no step timed (``--timed-step-every 0``);
* ``timed`` and ``exported``: telemetry's two halves apart (steps timed, records dropped; spans
  exported, no step timed);
* ``stock``: ``mlx.launch -n 2 --backend ring python -m mlx_lm server --pipeline``, mlx-lm's own
  distributed server.

Only the server measured runs: the others are paused (SIGSTOP; idle, a distributed server still
takes CPU: mlx.launch and stock rank 0 poll, a rank waiting in the ring's receive spins). Each rank
runs on a core of its own with what it started (its exporter process), as on a node of a cluster;
the client, the sink and mlx.launch float (``--no-pin``: every process floats). ``--rounds N``
rounds, each one run of every server in a random order; a run is ``--requests`` streamed greedy
requests one after the other (the same prompt; every server produces the same tokens). Per run:
tokens/s, the tokens over the time from each request's send to its last token (the spacing of
chunks at a client that shares two cores with spinning ranks is not the engine's: chunks arrive in
bursts), and the median TTFT. Per round, the ratio of the runs'; reported are their geometric mean
and a 95 % t-interval. Targets: telemetry / dropped >= 0.98 (telemetry costs at most 2 %);
dropped / stock >= 0.95 (the distributed engine within 5 % of mlx-lm's).

    python bench/cluster.py [--rounds 12] [--requests 3] [--tokens 128] [--servers ...] [--markdown]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from engine_overhead import _SINK, ratio_ci

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
PROMPT = [{"role": "user", "content": "Tell me about the sea, the ships on it and the people who sail them."}]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ranks(root: int) -> dict[int, int]:
    """pid -> rank of every process of the server whose root is ``root``: a process started with
    MLX_RANK (mlx.launch's ranks, a tokentrace engine's ranks above 0), the root where it is a
    tokentrace engine (rank 0), and what those started (exporter processes), by their parent."""
    group, parent, env_rank = os.getpgid(root), {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            if os.getpgid(pid) != group:
                continue
            parent[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ProcessLookupError):
            continue
        ranks = [int(item[9:]) for item in environ if item.startswith(b"MLX_RANK=")]
        if ranks:
            env_rank[pid] = ranks[0]
        elif pid == root and b"tokentrace\0engine" in cmdline:
            env_rank[pid] = 0
    found = {}
    for pid in parent:
        walk = pid
        while walk in parent and walk not in env_rank:
            walk = parent[walk]
        if walk in env_rank:
            found[pid] = env_rank[walk]
    return found


class Server:
    """One distributed server (its own process group, so that every rank stops with it)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str] | None = None):
        self.name, self.port = name, int(cmd[cmd.index("--port") + 1])
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-cluster-{name}-", suffix=".log", delete=False)  # noqa: SIM115 - the server owns it
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.name} not ready after {timeout} s")

    def pin(self) -> None:
        """Give each rank a core of its own, as each node of a cluster has its own (the rank's own
        processes, its exporter among them, go with it; mlx.launch and the client float): unpinned,
        two ranks that spin in the ring's receive and a client on two cores made the same run vary
        1.5x from one request to the next."""
        cpus = sorted(os.sched_getaffinity(0))
        for pid, rank in _ranks(self.proc.pid).items():
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):  # a thread that just ended
                    os.sched_setaffinity(int(tid), {cpus[rank % len(cpus)]})

    def request(self, tokens: int) -> tuple[float, int, float]:
        """(TTFT ms, tokens, seconds from send to the last token) of one streamed greedy request."""
        body = {"model": "default_model", "messages": PROMPT, "max_tokens": tokens, "temperature": 0.0,
                "stream": True}
        times, start = [], time.perf_counter()
        with httpx.stream("POST", f"http://127.0.0.1:{self.port}/v1/chat/completions", json=body,
                          timeout=300) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if any(choice.get("delta", {}).get("content") for choice in chunk.get("choices", [])):
                    times.append(time.perf_counter())
        if len(times) < 2:
            raise SystemExit(f"{self.name}: only {len(times)} content chunks; use a model that does not stop")
        return (times[0] - start) * 1000, len(times), times[-1] - start

    def pause(self) -> None:
        """SIGSTOP every process of the server: idle, a distributed server is not idle (rank 0 of
        mlx_lm.server and mlx.launch poll; a tokentrace rank above 0 spins in the ring's receive),
        and would take CPU from the one measured."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)
        self.wait_ready(60)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--requests", type=int, default=3, help="requests per run")
    parser.add_argument("--tokens", type=int, default=128, help="completion tokens per request")
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="leave the ranks to the scheduler instead of one core each")
    parser.add_argument("--servers", default="telemetry,dropped,stock",
                        help="which of telemetry, dropped, timed (steps timed, records dropped), exported (spans "
                             "exported, no step timed) and stock to run; every pair present is compared")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    model = work / "q2"
    subprocess.run([PYTHON, "-m", "tokentrace", "make-model", str(model), "--arch", "qwen2", "--size", args.size],
                   check=True, capture_output=True)
    sink = subprocess.Popen([PYTHON, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    sink_port = int(sink.stdout.readline())
    # --rank-timeout 0: a paused server's ring op would otherwise outlast the watchdog's deadline.
    engine = [PYTHON, "-m", "tokentrace", "engine", "--model", str(model), "--ranks", "2", "--parallel", "pipeline",
              "--spool-dir", str(work / "spool"), "--rank-timeout", "0"]
    export = ["--otlp-endpoint", f"http://127.0.0.1:{sink_port}"]
    made = {
        "telemetry": lambda: Server("telemetry", [*engine, "--port", str(_free_port()), *export]),
        "dropped": lambda: Server("dropped", [*engine, "--port", str(_free_port()), "--otlp-endpoint", "",
                                              "--timed-step-every", "0"], {"TOKENTRACE_ENGINE_TELEMETRY": "drop"}),
        # The two halves of telemetry's cost apart: steps timed, nothing exported; exported, no step timed.
        "timed": lambda: Server("timed", [*engine, "--port", str(_free_port()), "--otlp-endpoint", ""],
                                {"TOKENTRACE_ENGINE_TELEMETRY": "drop"}),
        "exported": lambda: Server("exported", [*engine, "--port", str(_free_port()), *export,
                                                "--timed-step-every", "0"]),
        "stock": lambda: Server("stock", [str(Path(PYTHON).parent / "mlx.launch"), "-n", "2", "--backend", "ring",
                                          "--starting-port", str(_free_port()), PYTHON, "-m", "mlx_lm", "server",
                                          "--model", str(model), "--pipeline", "--port", str(_free_port())]),
    }
    servers = [made[name]() for name in args.servers.split(",")]
    results: dict[str, list[tuple[float, float]]] = {server.name: [] for server in servers}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        for server in servers:
            server.wait_ready()
            server.request(args.tokens)  # warm: the first request of each compiles and fills caches
            if args.pin:
                server.pin()
            server.pause()
        counts = set()
        for _ in range(args.rounds):
            for server in random.sample(servers, len(servers)):
                server.resume()
                runs = [server.request(args.tokens) for _ in range(args.requests)]
                server.pause()
                counts.update(run[1] for run in runs)
                results[server.name].append((sum(r[1] for r in runs) / sum(r[2] for r in runs),
                                             statistics.median(r[0] for r in runs)))
    finally:
        for server in servers:
            server.stop()
        sink.kill()
    rows = []
    pairs_wanted = (("telemetry", "dropped"), ("timed", "dropped"), ("exported", "dropped"), ("dropped", "stock"),
                    ("telemetry", "stock"))
    for num, den in (pair for pair in pairs_wanted if set(pair) <= set(results)):
        pairs = list(zip(results[num], results[den], strict=True))
        rows.append((f"{num} / {den}", *(ratio_ci([a[i] / b[i] for a, b in pairs]) for i in range(2)),
                     *(statistics.median(run[i] for run in results[name]) for i in range(2) for name in (num, den))))
    print(f"{started}, {args.rounds} rounds x {args.requests} requests x {args.tokens} tokens ({sorted(counts)} "
          f"content chunks), {args.size} qwen2, 2 ranks, pipeline, "
          f"ranks {'each pinned to a core' if args.pin else 'unpinned'}, "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    if args.markdown:
        print("\n| comparison | tokens/s | TTFT | tokens/s (medians) | TTFT ms (medians) |\n|---|---:|---:|---:|---:|")
    for name, whole, ttft, a, b, ttft_a, ttft_b in rows:
        whole_text, ttft_text = (f"{x[0]:.3f} [{x[1]:.3f}, {x[2]:.3f}]" for x in (whole, ttft))
        if args.markdown:
            print(f"| {name} | **{whole_text}** | {ttft_text} | {a:.1f} / {b:.1f} | {ttft_a:.1f} / {ttft_b:.1f} |")
        else:
            print(f"{name:22s} tokens/s {whole_text}  ttft {ttft_text}  ({a:.1f} / {b:.1f} tokens/s, "
                  f"{ttft_a:.1f} / {ttft_b:.1f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
