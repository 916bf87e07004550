"""/metrics benchmark: what a Prometheus scrape costs once a collector has written many requests.

The metrics state (tokentrace.dashboards.prometheus) is fed the same normalized batches the writer
commits; a scrape folds what was written since the previous one and prints the exposition. So a
scrape's cost is the exposition (label sets, not rows) plus the rows of one scrape interval, never a
scan of the store. This script measures, side by side in one run:

- feeding: the writer-side cost of handing a batch over, and the fold rate (requests/s);
- a scrape with nothing pending, after ``--requests`` requests were folded (steady state);
- a scrape with one interval of new traffic pending (``--interval-requests``, e.g. 100 requests/s
  for 15 s);
- the per-request verdicts the background thread computes (cache verdict of a request that did not
  reuse its whole prompt, and the abnormal test), on a store of ``--store-requests`` requests built
  through the real normalizer and writer (bench/analyze.py's generator and builder).

Engine-shaped requests come from bench/synth.py (4 instances, shared prefixes). To reach 1.1M folded
requests without generating 1.1M, a generated set of ``--unique`` requests is folded repeatedly:
the exposition's size depends on label sets (instances, models, categories, causes), which the
repeats do not change.

    python bench/metrics.py [--requests 1100000] [--unique 50000] [--interval-requests 1500]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from analyze import START_NS, build
from synth import Workload

from tokentrace.collector.decoding.normalize import Batch, normalize
from tokentrace.collector.stores.store_duckdb import DuckDBStore
from tokentrace.dashboards.prometheus import MetricsState

INGEST = {"accepted_spans": 0, "rejected": {"malformed": 3}, "queue_batches": 0, "queue_capacity": 256}


def generate(requests: int, spans_per_batch: int = 512) -> list[Batch]:
    """Normalized batches of about ``requests`` engine-shaped requests."""
    workload = Workload(seed=11, instances=4, start_ns=START_NS)
    batches, source = [], workload.batches(spans_per_batch)
    while workload.count < requests:
        batches.append(normalize(next(source)))
    return batches


def _ms(function, *args) -> float:
    began = time.perf_counter()
    function(*args)
    return (time.perf_counter() - began) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1_100_000, help="requests folded before scraping")
    parser.add_argument("--unique", type=int, default=50_000, help="requests generated (folded repeatedly)")
    parser.add_argument("--interval-requests", type=int, default=1_500, help="new requests in one scrape interval")
    parser.add_argument("--store-requests", type=int, default=20_000, help="store for the per-request verdicts")
    parser.add_argument("--samples", type=int, default=20)
    args = parser.parse_args()

    began = time.perf_counter()
    batches = generate(args.unique)
    per_pass = sum(len(b.rows["requests"]) for b in batches)
    print(f"generated {per_pass:,} requests in {len(batches):,} batches ({time.perf_counter() - began:.0f} s)")

    with tempfile.TemporaryDirectory(prefix="tokentrace-metrics-") as tmp:
        store = DuckDBStore(Path(tmp) / "empty.duckdb")
        # Verdicts off for the feed (queue of 0): folding alone is what a scrape pays.
        state = MetricsState(store, None, max_pending_verdicts=0)
        handed, folded, passes = [], 0, 0
        fold_began = time.perf_counter()
        while folded < args.requests:
            for batch in batches:
                t0 = time.perf_counter()
                state.observe(batch)
                handed.append(time.perf_counter() - t0)
            folded += per_pass
            passes += 1
            state.render(INGEST)
        fold_s = time.perf_counter() - fold_began
        steady = [_ms(state.render, INGEST) for _ in range(args.samples)]
        text = state.render(INGEST)
        interval = generate(args.interval_requests, 256)
        pending = []
        for _ in range(args.samples):
            for batch in interval:
                state.observe(batch)
            pending.append(_ms(state.render, INGEST))
        state.close()
        store.close()

        print(f"\nfolded {folded:,} requests ({passes} passes) in {fold_s:.1f} s: {folded / fold_s:,.0f} requests/s; "
              f"hand-over on the writer thread median {statistics.median(handed) * 1e6:.1f} µs / batch "
              f"(max {max(handed) * 1e3:.1f} ms, a fold when {50_000:,} rows are pending)")
        print(f"exposition: {len(text.splitlines()):,} lines, {len(text.encode()) / 1024:.0f} KiB")
        print(f"scrape, nothing pending:           median {statistics.median(steady):6.1f} ms, "
              f"max {max(steady):6.1f} ms   (target <= 100 ms)")
        print(f"scrape, {sum(len(b.rows['requests']) for b in interval):,} new requests pending: median "
              f"{statistics.median(pending):6.1f} ms, max {max(pending):6.1f} ms")

        path = Path(tmp) / "store.duckdb"
        built = build(path, args.store_requests)
        store = DuckDBStore(path, read_only=True)
        state = MetricsState(store, None)
        rows = store.requests(limit=args.store_requests)
        rows = rows.filter(rows["cached_tokens"] < rows["prompt_tokens"] - 1).tail(args.samples)
        verdict = []
        for row in rows.iter_rows(named=True):
            row["category"] = "prefill"
            verdict.append(_ms(state._verdict, row, state._history[row["instance_id"]].before(row)))
        state.close()
        store.close()
        print(f"\nper-request verdict (store of {args.store_requests:,} requests, built in {built:.0f} s), "
              f"{len(verdict)} requests that did not reuse their whole prompt: median "
              f"{statistics.median(verdict):.1f} ms, max {max(verdict):.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
