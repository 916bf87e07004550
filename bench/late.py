"""Late spans: what the writer's exact check costs for spans older than its memory of span keys.

The writer judges a span new without a query when its key is not remembered and it ended after
the memory's horizon (collector/stores/once.py); a span that ended before it (an engine's spool replayed
after an outage, an exporter's backlog) is looked up in the store (named query ``span_keys``), on
the writer thread every sender waits on. This fills a DuckDB store with ``--stored`` cached engine
batches (bench/ingest.py's, ~460 spans each), opens it again (the memory loads what it held), then
writes, one at a time and timed on the calling thread as the writer does:

- *recent*: new batches from after the stored ones (no lookup);
- *late*: new batches whose span times are moved an hour back (past the horizon: every span asked);
- *resent late*: stored batches sent again with the memory emptied (every span asked and found).

    python bench/late.py [--stored 2000] [--batches 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from ingest import _parse, make_bodies

from tokentrace.collector.decoding.columns import Columns
from tokentrace.collector.stores.store_duckdb import DuckDBStore

HOUR_NS = 3600 * 10**9


def moved(columns: Columns, by_ns: int) -> Columns:
    """``columns`` with its spans' start and end times ``by_ns`` earlier (the only times the check reads)."""
    spans = columns.tables["spans"]
    for name in ("start_ns", "end_ns"):
        spans = spans.set_column(spans.column_names.index(name), name, pc.subtract(spans.column(name), by_ns))
    columns.tables["spans"] = spans
    return columns


def timed(store: DuckDBStore, batches: list[Columns], forget: bool = False) -> tuple[float, float, int]:
    """(median wall ms, median thread CPU ms, spans left out as stored) of writing ``batches`` one by one."""
    walls, cpus, duplicates = [], [], 0
    for batch in batches:
        if forget:  # memory empty and its horizon past every span: each one is asked of the store
            store._keys = type(store._keys)()
            store._keys.horizon = 2**40
        began, began_cpu = time.perf_counter(), time.thread_time()
        store.write(batch)
        walls.append((time.perf_counter() - began) * 1e3)
        cpus.append((time.thread_time() - began_cpu) * 1e3)
        duplicates += batch.duplicates
    return statistics.median(walls), statistics.median(cpus), duplicates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stored", type=int, default=2000, help="cached engine batches stored first")
    parser.add_argument("--batches", type=int, default=20, help="batches written in each case")
    args = parser.parse_args()
    bodies = make_bodies(6000, 512)
    stored, later = bodies[args.batches:args.batches + args.stored], bodies[args.batches + args.stored:]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "late.duckdb"
        store = DuckDBStore(path)
        for body, _ in stored:
            store.write(_parse(body))
        store.close()
        store = DuckDBStore(path)
        try:
            print(f"store of {store.counts()['spans']:,} engine spans; {args.batches} batches a case, one by one")
            early = bodies[:args.batches]
            cases = [("recent", [_parse(body) for body, _ in later[:args.batches]], False),
                     ("late (an hour back)", [moved(_parse(body), HOUR_NS) for body, _ in early], False),
                     ("resent late", [_parse(body) for body, _ in stored[-args.batches:]], True)]
            for label, batches, forget in cases:
                spans = sum(batch.spans for batch in batches)
                wall, cpu, duplicates = timed(store, batches, forget)
                print(f"  {label:20s} write median {wall:6.1f} ms, writer CPU {cpu:6.1f} ms a batch of "
                      f"~{spans // len(batches)} spans; left out as stored: {duplicates:,} of {spans:,}")
        finally:
            store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
