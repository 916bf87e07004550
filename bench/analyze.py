"""Analyzer benchmark: verdict and report latency on a large store built through the normalizer.

Builds (once, cached under .cache/) a DuckDB store from generated engine-shaped OTLP (bench/synth.py)
through the real normalizer and writer, across 4 instances, then measures:
- ``analyze slow`` and ``analyze cache`` query time for random requests (in-process, warm);
- CLI wall time of ``tokentrace analyze slow|cache --db FILE --json`` including Python start-up;
- ``analyze report --since 1h`` query time and CLI wall time;
and prints the store size on disk and bytes per span.

    python bench/analyze.py [--requests 200000] [--samples 20]
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import subprocess
import sys
import time
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


def _time(function, *args) -> float:
    began = time.perf_counter()
    function(*args)
    return (time.perf_counter() - began) * 1000


def _cli(*args: str) -> float:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "tokentrace", "analyze", *args], check=True, capture_output=True)
    return (time.perf_counter() - began) * 1000


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
    slow = [_time(analyze_slowness, store, rid) for rid in sample]
    cache = [_time(analyze_cache, store, rid) for rid in sample]
    last = store.frame("requests", since_ns=None, until_ns=None, instance_id=None, limit=1)["end_ns"][0]
    report = [_time(summarize, store, last - 3_600_000_000_000, None) for _ in range(3)]
    store.close()

    def line(name: str, values: list[float], target: float) -> None:
        values = sorted(values)
        print(f"{name:<28} median {statistics.median(values):8.1f} ms   max {values[-1]:8.1f} ms   "
              f"(target <= {target:,.0f} ms)")

    line("analyze slow (query)", slow, 100)
    line("analyze cache (query)", cache, 100)
    line("analyze report --since 1h", report, 2000)
    cli_slow = [_cli("slow", "--request-id", rid, "--db", str(path), "--json") for rid in sample[:5]]
    cli_cache = [_cli("cache", "--request-id", rid, "--db", str(path), "--json") for rid in sample[:5]]
    line("CLI analyze slow (wall)", cli_slow, 1500)
    line("CLI analyze cache (wall)", cli_cache, 1500)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
