"""What does a distributed tokentrace engine cost? Two ranks on the ring, three servers side by side.

Three servers on one generated qwen2 model, each two ranks over MLX's ring backend on 127.0.0.1,
pipeline placement (issue 46's acceptance):

* ``telemetry``: ``tokentrace engine --ranks 2 --parallel pipeline``, spans exported to a sink
  process (an HTTP server that reads and drops them), one step in 8 timed per rank (the default);
* ``dropped``: the same engine with its records thrown away before the telemetry thread
  (``TOKENTRACE_ENGINE_TELEMETRY=drop``) and no step timed (``--timed-step-every 0``);
* ``stock``: ``mlx.launch -n 2 --backend ring python -m mlx_lm server --pipeline``, mlx-lm's own
  distributed server.

Only the server measured runs: the others are paused (SIGSTOP; idle, a distributed server still
takes CPU: mlx.launch and stock rank 0 poll, a tokentrace rank above 0 spins in the ring's
receive). ``--rounds N`` rounds, each one run of every server in a random order; a run is ``--requests``
streamed greedy requests one after the other (the same prompt; every server produces the same
tokens). Per request: decode tokens/s ((tokens - 1) / (last - first token)) and TTFT at the client.
Per round, the ratio of the runs' medians; reported are their geometric mean and a 95 % t-interval.
Targets: telemetry / dropped decode >= 0.98 (telemetry costs at most 2 %); dropped / stock decode
>= 0.95 (the distributed engine within 5 % of mlx-lm's).

    python bench/cluster.py [--rounds 12] [--requests 3] [--tokens 128] [--markdown]
"""

from __future__ import annotations

import argparse
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

    def request(self, tokens: int) -> tuple[float, float, int]:
        """(TTFT ms, decode tokens/s, tokens) of one streamed greedy request."""
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
        return (times[0] - start) * 1000, (len(times) - 1) / (times[-1] - times[0]), len(times)

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
    servers = [
        Server("telemetry", [*engine, "--port", str(_free_port()), "--otlp-endpoint", f"http://127.0.0.1:{sink_port}"]),
        Server("dropped", [*engine, "--port", str(_free_port()), "--otlp-endpoint", "", "--timed-step-every", "0"],
               {"TOKENTRACE_ENGINE_TELEMETRY": "drop"}),
        Server("stock", [str(Path(PYTHON).parent / "mlx.launch"), "-n", "2", "--backend", "ring",
                         "--starting-port", str(_free_port()), PYTHON, "-m", "mlx_lm", "server", "--model", str(model),
                         "--pipeline", "--port", str(_free_port())]),
    ]
    results: dict[str, list[tuple[float, float]]] = {server.name: [] for server in servers}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        for server in servers:
            server.wait_ready()
            server.request(args.tokens)  # warm: the first request of each compiles and fills caches
            server.pause()
        counts = set()
        for _ in range(args.rounds):
            for server in random.sample(servers, len(servers)):
                server.resume()
                runs = [server.request(args.tokens) for _ in range(args.requests)]
                server.pause()
                counts.update(tokens for _, _, tokens in runs)
                results[server.name].append((statistics.median(r[1] for r in runs),
                                             statistics.median(r[0] for r in runs)))
    finally:
        for server in servers:
            server.stop()
        sink.kill()
    rows = []
    for num, den in (("telemetry", "dropped"), ("dropped", "stock"), ("telemetry", "stock")):
        pairs = list(zip(results[num], results[den], strict=True))
        rows.append((f"{num} / {den}", ratio_ci([a[0] / b[0] for a, b in pairs]),
                     ratio_ci([a[1] / b[1] for a, b in pairs]),
                     statistics.median(a[0] for a, _ in pairs), statistics.median(b[0] for _, b in pairs)))
    print(f"{started}, {args.rounds} rounds x {args.requests} requests x {args.tokens} tokens ({sorted(counts)} "
          f"content chunks), {args.size} qwen2, 2 ranks, pipeline, load average {os.getloadavg()[0]:.2f} at the end")
    if args.markdown:
        print("\n| comparison | decode tokens/s | TTFT | decode tokens/s (medians) |\n|---|---:|---:|---:|")
    for name, decode, ttft, a, b in rows:
        text = f"{decode[0]:.3f} [{decode[1]:.3f}, {decode[2]:.3f}]"
        ttft_text = f"{ttft[0]:.3f} [{ttft[1]:.3f}, {ttft[2]:.3f}]"
        if args.markdown:
            print(f"| {name} | **{text}** | {ttft_text} | {a:.1f} / {b:.1f} |")
        else:
            print(f"{name:22s} decode {text}  ttft {ttft_text}  ({a:.1f} / {b:.1f} tokens/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
