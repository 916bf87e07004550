"""Run the whole story on this machine: a collector and two engine instances on a tiny generated
model (nothing is downloaded), a scripted workload that produces every slowness category and every
cache-miss cause, and a table of the verdicts. The engines then stop (flushing their telemetry); the
collector and its dashboard stay up until Ctrl-C (``--exit`` stops after printing). Exit status 1
when a verdict is not the one its scenario shows.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

from tokentrace.analyzers.evidence import fmt_ms
from tokentrace.errors import TokentraceError

INSTANCES = {"A": "demo-a", "B": "demo-b"}
#: Which evidence the table shows first: the most specific fact of each verdict.
KEY_EVIDENCE = ("outcome", "prefill_interference", "blocker", "load", "eviction", "restart", "cached_elsewhere",
                "divergence", "too_short", "not_cached_yet", "new_prefix", "reused", "prefill_tokens", "tpot")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tokentrace demo``."""
    parser.add_argument("--exit", action="store_true", help="stop after printing the verdicts")
    parser.add_argument("--port", type=int, default=4318,
                        help="collector port (default 4318; 0, or a taken port, picks a free one)")
    parser.add_argument("--workdir", default=None,
                        help="where the model, store and logs go, kept afterwards (default: a temporary "
                             "directory, removed when the demo stops)")


def _free_port(preferred: int | None = None) -> int:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", preferred or 0))
        except OSError:
            sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, timeout: float = 5) -> tuple[int, dict | None]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


def _wait(what: str, check, timeout: float, processes: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        for proc in processes:
            if proc.poll() is not None:
                raise TokentraceError(f"{what}: a process exited with {proc.returncode} (logs in the workdir)")
        if time.monotonic() > deadline:
            raise TokentraceError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


class Stack:
    """The demo's processes: one collector, engines A and B, with logs in the workdir."""

    def __init__(self, workdir: Path, port: int):
        self.workdir = workdir
        self.port = port
        self.collector_url = f"http://127.0.0.1:{port}"
        self.engine_urls: dict[str, str] = {}
        self.processes: list[subprocess.Popen] = []

    def _spawn(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen([sys.executable, "-m", "tokentrace", *args], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.processes.append(proc)
        return proc

    def start(self, model: Path) -> None:
        """Start the collector and both engines; B loads lazily, on its first request."""
        from tokentrace.demo_workload import INSTANCE_FLAGS

        self._spawn("collector", "collector", "--db", str(self.workdir / "demo.duckdb"), "--port", str(self.port),
                    "--spool-dir", str(self.workdir / "spool"), "--log-level", "warning")
        for key, instance in INSTANCES.items():
            port = _free_port()
            self.engine_urls[key] = f"http://127.0.0.1:{port}"
            self._spawn(f"engine-{key}", "engine", "--model", str(model), "--port", str(port), "--instance-id",
                        instance, "--otlp-endpoint", self.collector_url, "--spool-dir",
                        str(self.workdir / f"spool-{key}"), "--heartbeat-interval", "1", *INSTANCE_FLAGS[key])
        _wait("the collector", lambda: _get(self.collector_url + "/healthz")[0] == 200, 60, self.processes)
        _wait("engine A to load", lambda: _get(self.engine_urls["A"] + "/health")[0] == 200, 120, self.processes)
        _wait("engine B to listen", lambda: _get(self.engine_urls["B"] + "/health")[0] in (200, 503), 120,
              self.processes)

    def stop(self, engines_only: bool = False) -> None:
        """Engines first (each flushes its telemetry before exiting), then the collector."""
        for proc in reversed(self.processes[1:] if engines_only else self.processes):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()


def collect_verdicts(collector_url: str, request_ids: list[str]) -> dict[str, dict]:
    """Both verdicts of each request. Call after the engines stopped: an engine exits only once its
    telemetry is exported, and the collector acknowledges only what it committed."""
    verdicts = {}
    for request_id in request_ids:
        status, body = _get(f"{collector_url}/api/requests/{request_id}/verdict", timeout=60)
        if status != 200:
            raise TokentraceError(f"the collector has no verdict for {request_id} (HTTP {status})")
        verdicts[request_id] = body
    return verdicts


def verdict_holds(shown, verdicts: dict) -> bool:
    """Whether a request got the verdict its scenario shows."""
    slow, cache = verdicts["slow"], verdicts["cache"]
    if shown.verdict == "outcome":
        return slow["outcome"] == shown.expect and slow["category"] is None
    if shown.verdict == "slow":
        return slow["abnormal"] is False if shown.expect is None else slow["category"] == shown.expect
    return cache["cause"] == shown.expect and (shown.expect is not None or cache["result"] == "hit")


#: Width of the evidence column: longer evidence ends at a word, with an ellipsis.
EVIDENCE_WIDTH = 110
LEGEND = ("abnormal? compares the request's slowest component with its instance's own recent requests: "
          "yes, no, or n/a when fewer than 3 comparable requests exist to judge by.")


def render_table(shown: list, verdicts: dict[str, dict]) -> str:
    """One line per request shown: its scenarios, id, instance, both verdicts, the key evidence.

    A request that shows two scenarios (a slowness and a cache verdict) is one row; its mark is ✓
    only when both verdicts hold."""
    from tokentrace.analyzers.cache import NO_CAUSE

    rows: dict[str, list] = {}
    for item in shown:
        rows.setdefault(item.request_id, []).append(item)
    labels = {request_id: " + ".join(item.label for item in items) for request_id, items in rows.items()}
    width = max(36, *(len(label) + 2 for label in labels.values()))
    lines = [f"{'':2}{'scenario':<{width}}{'request':<20}{'inst':<8}{'slow (abnormal?)':<24}{'cache':<26}evidence"]
    for request_id, items in rows.items():
        slow, cache = verdicts[request_id]["slow"], verdicts[request_id]["cache"]
        abnormal = {True: "yes", False: "no", None: "n/a"}[slow["abnormal"]]
        cache_text = f"{cache['result'] or 'no lookup'}/{cache['cause'] or NO_CAUSE}"
        pool = slow["evidence"] if items[0].verdict != "cache" else cache["evidence"]
        ranked = sorted(pool, key=lambda e: KEY_EVIDENCE.index(e["kind"]) if e["kind"] in KEY_EVIDENCE else 99)
        key = ranked[0] if ranked else None
        mark = "✓" if all(verdict_holds(item, verdicts[request_id]) for item in items) else "✗"
        evidence = textwrap.shorten((key or {}).get("text", ""), EVIDENCE_WIDTH, placeholder=" …")
        lines.append(f"{mark} {labels[request_id]:<{width}}{request_id:<20}{INSTANCES[items[0].instance]:<8}"
                     f"{(slow['category'] or slow['outcome']) + ' (' + abnormal + ')':<24}{cache_text:<26}{evidence}")
    lines.append(LEGEND)
    return "\n".join(lines)


#: Pieces of advice the demo prints (the best; ``analyze advise`` and /advice give them all).
ADVICE_SHOWN = 3


def render_advice(collector_url: str) -> str:
    """The best changes over the demo's traffic, one line each, as ``analyze advise`` ranks them."""
    from tokentrace.analyzers.render import ADVICE_KINDS

    status, advice = _get(f"{collector_url}/api/advice?since=all", timeout=120)
    if status != 200 or not advice or not advice.get("advice"):
        return "\nno advice over this traffic" + ("" if status == 200 else f" (the collector answered {status})")
    lines = ["\nwhat would have saved the most (analyze advise):"]
    for rank, item in enumerate(advice["advice"][:ADVICE_SHOWN], 1):
        best = item["changes"][0]
        saved = "" if best["saved_ms"] is None else f" [{fmt_ms(best['saved_ms'])} less waiting]"
        lines.append(f"  {rank}. {ADVICE_KINDS[item['kind']]}: {best['change']}{saved}")
    return "\n".join(lines)


def _wait_for_interrupt() -> None:
    def interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping ...", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Generate the model, start the stack, run the workload, print the verdicts."""
    from tokentrace.demo_workload import Cluster, run_workload

    began = time.monotonic()
    temporary = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tokentrace-demo-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    port = _free_port(args.port)
    if args.port and port != args.port:
        print(f"port {args.port} is taken; the collector uses {port}", file=sys.stderr)
    model = workdir / "tiny-model"
    if not (model / "config.json").exists():
        print("generating a tiny random-weight model ...", flush=True)
        subprocess.run([sys.executable, "-m", "tokentrace", "make-model", str(model), "--size", "tiny"],
                       check=True, capture_output=True)
    for stale in ("demo.duckdb", "demo.duckdb.wal"):  # each run tells its own story
        (workdir / stale).unlink(missing_ok=True)
    stack = Stack(workdir, port)
    try:
        print(f"starting a collector and two engines (logs in {workdir}) ...", flush=True)
        stack.start(model)
        print(f"  ready after {time.monotonic() - began:.0f} s", flush=True)
        shown = run_workload(Cluster(stack.engine_urls),
                             lambda step: print(f"  [{time.monotonic() - began:4.0f} s] {step}", flush=True))
        stack.stop(engines_only=True)
        verdicts = collect_verdicts(stack.collector_url, sorted({item.request_id for item in shown}))
        print()
        print(render_table(shown, verdicts))
        held = all(verdict_holds(item, verdicts[item.request_id]) for item in shown)
        print(f"\n{sum(verdict_holds(i, verdicts[i.request_id]) for i in shown)} of {len(shown)} verdicts as "
              f"expected ({len(verdicts)} requests), in {time.monotonic() - began:.0f} s.")
        print(render_advice(stack.collector_url))
        print(f"dashboard: {stack.collector_url}/   ·   try: tokentrace analyze slow --request-id demo-queued "
              f"--url {stack.collector_url}   ·   tokentrace analyze advise --since all --url {stack.collector_url}")
        if not args.exit:
            print("the engines have stopped; the collector and its dashboard keep running until Ctrl-C"
                  + (" (then the demo's temporary directory is removed)." if temporary else "."), flush=True)
            _wait_for_interrupt()
        return 0 if held else 1
    finally:
        stack.stop()
        if temporary:
            shutil.rmtree(workdir, ignore_errors=True)
