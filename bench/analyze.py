"""Analyzer benchmark: verdict and report latency on a large store built through the normalizer.

Builds (once, cached under .cache/) a DuckDB store from generated engine-shaped OTLP (bench/synth.py)
through the real normalizer and writer, across 4 instances, then measures:
- ``analyze slow`` and ``analyze cache`` query time for random requests (in-process, warm);
- CLI wall time of ``tokentrace analyze slow|cache --db FILE --json`` including Python start-up, and
  of the same through a collector serving the file (``--url``), next to the floors measured in the
  same run: ``python -c pass`` and ``python -c "import duckdb, polars, pyarrow"``;
- ``analyze report --since 1h`` query time and CLI wall time;
and prints the store size on disk and bytes per span. Every figure is given as wall time and as CPU
time (of this process, or of the CLI child): on a shared machine wall time measures the neighbours
as much as the code, CPU time much less so.

    python bench/analyze.py [--requests 200000] [--samples 20]
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from synth import Workload

from tokentrace.analyzers.cache import analyze_cache
from tokentrace.analyzers.report import summarize
from tokentrace.analyzers.slowness import analyze_slowness
from tokentrace.collector.normalize import Batch, normalize
from tokentrace.collector.store_duckdb import DuckDBStore

CACHE = Path(__file__).resolve().parents[1] / ".cache"
CHUNK = 2000  # requests per generation task
START_NS = 1_790_000_000_000_000_000


def _generate(task: tuple[int, int]) -> Batch:
    """Requests [first, first + count) of the workload, normalized (runs in a worker process)."""
    first, count = task
    workload = Workload(seed=first, instances=4, start_ns=START_NS + first * 20_000_000)
    workload.count = first
    merged = Batch()
    batches = workload.batches(512)
    while workload.count < first + count:
        merged.extend(normalize(next(batches)))
    return merged


def build(path: Path, requests: int) -> float:
    """Write the store; returns seconds taken."""
    began = time.perf_counter()
    store = DuckDBStore(path)
    tasks = [(first, min(CHUNK, requests - first)) for first in range(0, requests, CHUNK)]
    with multiprocessing.get_context("spawn").Pool(max(1, (multiprocessing.cpu_count() or 2))) as pool:
        for done, batch in enumerate(pool.imap(_generate, tasks), start=1):
            store.write(batch)
            if done % 10 == 0:
                print(f"  {done * CHUNK:,} requests written", flush=True)
    store.close()
    return time.perf_counter() - began


def _time(function, *args) -> tuple[float, float]:
    """(wall ms, CPU ms of this process: every thread, DuckDB's included)."""
    began, cpu = time.perf_counter(), time.process_time()
    function(*args)
    return (time.perf_counter() - began) * 1000, (time.process_time() - cpu) * 1000


def _child(*argv: str) -> tuple[float, float]:
    """(wall ms, CPU ms user + system) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    subprocess.run([sys.executable, *argv], check=True, capture_output=True)
    wall = (time.perf_counter() - began) * 1000
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) * 1000


def _cli(*args: str) -> tuple[float, float]:
    return _child("-m", "tokentrace", "analyze", *args)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(path: Path, workdir: str) -> tuple[subprocess.Popen, str]:
    """A collector on ``path`` (for the ``--url`` figures), once /healthz answers."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "tokentrace", "collector", "--db", str(path), "--port", str(port),
                             "--log-level", "warning"], cwd=workdir, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the collector exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=5) as answer:
                if answer.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)  # polling a starting server's port: nothing to wait on but the port
    proc.kill()
    raise SystemExit("the collector did not answer /healthz within 300 s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--rebuild", action="store_true", help="build the store even if a cached one exists")
    args = parser.parse_args()

    CACHE.mkdir(exist_ok=True)
    path = CACHE / f"bench-analyze-{args.requests}.duckdb"
    if args.rebuild or not path.exists():
        path.unlink(missing_ok=True)
        print(f"building a store of {args.requests:,} requests through the normalizer ...")
        print(f"  built in {build(path, args.requests):.0f} s")
    store = DuckDBStore(path, read_only=True)
    counts = store.counts()
    size = path.stat().st_size
    print(f"store: {path.name}, {size / 2**20:,.0f} MiB on disk; {counts['spans']:,} spans "
          f"({size / counts['spans']:,.0f} bytes per span), {counts['requests']:,} requests, "
          f"{sum(counts.values()):,} rows in all (decode_steps {counts['decode_steps']:,}, "
          f"prefix_blocks {counts['prefix_blocks']:,})")

    ids = store.frame("requests", since_ns=None, until_ns=None, instance_id=None,
                      limit=args.requests)["request_id"].to_list()
    sample = random.Random(3).sample(ids, min(args.samples, len(ids)))
    for rid in sample[:3]:  # warm: the first verdicts read the file's pages in
        analyze_slowness(store, rid)
        analyze_cache(store, rid)
    slow = [_time(analyze_slowness, store, rid) for rid in sample]
    cache = [_time(analyze_cache, store, rid) for rid in sample]
    last = store.frame("requests", since_ns=None, until_ns=None, instance_id=None, limit=1)["end_ns"][0]
    report = [_time(summarize, store, last - 3_600_000_000_000, None) for _ in range(3)]
    store.close()
    print(f"load average {_load()} (at the start of the timings)")

    def line(name: str, values: list[tuple[float, float]], target: float) -> None:
        walls, cpus = sorted(w for w, _ in values), sorted(c for _, c in values)
        p99 = max(0, -(-99 * len(walls) // 100) - 1)  # nearest rank
        print(f"{name:<30} wall median {statistics.median(walls):8.1f} p99 {walls[p99]:8.1f} ms   "
              f"CPU median {statistics.median(cpus):8.1f} p99 {cpus[p99]:8.1f} ms   (target <= {target:,.0f} ms)")

    line("analyze slow (query)", slow, 100)
    line("analyze cache (query)", cache, 100)
    line("analyze report --since 1h", report, 1000)
    runs = min(5, len(sample))
    line("python -c pass (floor)", [_child("-c", "pass") for _ in range(runs)], 300)
    line("import duckdb+polars+pyarrow", [_child("-c", "import duckdb, polars, pyarrow") for _ in range(runs)], 300)
    line("CLI analyze slow --db", [_cli("slow", "--request-id", rid, "--db", str(path), "--json")
                                   for rid in sample[:runs]], 300)
    line("CLI analyze cache --db", [_cli("cache", "--request-id", rid, "--db", str(path), "--json")
                                    for rid in sample[:runs]], 300)
    with tempfile.TemporaryDirectory() as workdir:
        collector, url = _serve(path, workdir)
        try:
            line("CLI analyze slow --url", [_cli("slow", "--request-id", rid, "--url", url, "--json")
                                            for rid in sample[:runs]], 300)
            line("CLI analyze cache --url", [_cli("cache", "--request-id", rid, "--url", url, "--json")
                                             for rid in sample[:runs]], 300)
        finally:
            collector.send_signal(signal.SIGTERM)
            collector.wait(120)
    return 0


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "n/a"


if __name__ == "__main__":
    raise SystemExit(main())
