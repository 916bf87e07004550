"""What does the gateway add? The same mlx_lm.server reached directly and through ``tokentrace gateway``,
side by side in one run.

One ``mlx_lm.server`` on a generated model (``--size small`` by default), one gateway in front of it
reporting to a real collector (so the observer's span building and export run as in production),
one client. Requests alternate direct, gateway, direct, ... with the same prompts, one stream at a
time, each prompt unique so the prompt cache does the same work on both paths. Per request the
client measures TTFT (send -> first content chunk) and decode throughput
((content chunks - 1) / (last - first content chunk)).

Reported: medians per path, the added median TTFT in ms (gateway - direct, median of the per-pair
differences) and the decode throughput ratio (median of per-pair ratios). Targets (issue 13):
<= 1 ms added TTFT, <= 2 % decode throughput. ``--markdown`` prints the table row for
docs/benchmarks.md. On a shared machine the pairwise medians are what to read.

    python bench/gateway_overhead.py [--size small] [--pairs 30] [--max-tokens 64] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ok(url: str, timeout: float, check=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            response = httpx.get(url, timeout=2)
            if response.status_code == 200 and (check is None or check(response.json())):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {url}")


def spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def one(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> tuple[float, float | None]:
    """(TTFT ms, decode tokens/s) of one streamed request."""
    body = {"model": "default_model", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}]}
    times = []
    start = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                times.append(time.perf_counter())
    if not times:
        raise SystemExit("no content streamed")
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 else None
    return (times[0] - start) * 1e3, decode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tokentrace-gw-bench-"))
    model = work / args.size
    subprocess.run([sys.executable, "-m", "tokentrace", "make-model", str(model), "--size", args.size],
                   check=True, capture_output=True)
    ports = {name: free_port() for name in ("engine", "collector", "gateway")}
    procs = [
        spawn([sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(ports["engine"])],
              work / "mlx.log"),
        spawn([sys.executable, "-m", "tokentrace", "collector", "--db", str(work / "store.duckdb"), "--port",
               str(ports["collector"]), "--log-level", "warning"], work / "collector.log"),
    ]
    direct, collector = f"http://127.0.0.1:{ports['engine']}", f"http://127.0.0.1:{ports['collector']}"
    try:
        wait_ok(direct + "/health", 120)
        wait_ok(collector + "/healthz", 60)
        procs.append(spawn([sys.executable, "-m", "tokentrace", "gateway", "--upstream", f"m={direct}",
                            "--port", str(ports["gateway"]), "--otlp-endpoint", collector, "--tokenizer", str(model),
                            "--spool-dir", str(work / "spool"), "--log-level", "warning"], work / "gateway.log"))
        gateway = f"http://127.0.0.1:{ports['gateway']}"
        wait_ok(gateway + "/health", 120, lambda body: body.get("status") == "ok")
        rows = {"direct": [], "gateway": []}
        with httpx.Client(timeout=300) as client:
            for i in range(3):  # warm both paths (connections, first-request costs)
                one(client, direct, f"warm {i}", 8)
                one(client, gateway, f"warm {i} via", 8)
            for i in range(args.pairs):
                order = ("direct", "gateway") if i % 2 == 0 else ("gateway", "direct")
                for path in order:
                    url = direct if path == "direct" else gateway
                    prompt = f"pair {i} {path}: write a long story about ships"
                    rows[path].append(one(client, url, prompt, args.max_tokens))
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    added = [g[0] - d[0] for d, g in zip(rows["direct"], rows["gateway"], strict=True)]
    ratio = [g[1] / d[1] for d, g in zip(rows["direct"], rows["gateway"], strict=True) if d[1] and g[1]]
    summary = {
        "size": args.size, "pairs": args.pairs, "max_tokens": args.max_tokens, "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "ttft_ms_direct_p50": round(statistics.median(r[0] for r in rows["direct"]), 2),
        "ttft_ms_gateway_p50": round(statistics.median(r[0] for r in rows["gateway"]), 2),
        "added_ttft_ms_p50": round(statistics.median(added), 3),
        "decode_tok_s_direct_p50": round(statistics.median(r[1] for r in rows["direct"] if r[1]), 1),
        "decode_tok_s_gateway_p50": round(statistics.median(r[1] for r in rows["gateway"] if r[1]), 1),
        "decode_ratio_p50": round(statistics.median(ratio), 4) if ratio else None,
    }
    if args.markdown:
        print("| model | pairs | TTFT direct p50 | TTFT gateway p50 | added TTFT (pairwise p50) | decode direct | "
              "decode gateway | decode ratio (pairwise p50) |")
        print("|---|---|---|---|---|---|---|---|")
        print(f"| {args.size} | {args.pairs} | {summary['ttft_ms_direct_p50']} ms "
              f"| {summary['ttft_ms_gateway_p50']} ms "
              f"| {summary['added_ttft_ms_p50']} ms | {summary['decode_tok_s_direct_p50']} tok/s | "
              f"{summary['decode_tok_s_gateway_p50']} tok/s | {summary['decode_ratio_p50']} |")
    else:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
