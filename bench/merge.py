"""Merge benchmark: the CPU the DuckDB store's merge thread spends per engine span, by merge size.

Decodes engine-shaped batches (bench/synth.py, as bench/ingest.py sends them) and appends them to
fresh stores the way the merge thread does (``DuckDBStore._merge``: every table in one transaction,
the journal's sequence number with them), ``--groups`` batches per merge, each size into a store of
its own and the sizes taken in turn, round after round, so that a host whose speed drifts (this
project's VM: up to 2x within an hour) moves every size alike. Prints, per size, the merge thread's
CPU per span (``time.thread_time``: DuckDB runs its work on the calling thread with ``threads = 1``),
how much of it the COMMIT took, and each size's ratio to the first.

    python bench/merge.py [--batches 1200] [--groups 60,150] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from ingest import _parse, make_bodies

from tokentrace.collector import journal
from tokentrace.collector.store_duckdb import DuckDBStore


class _TimedCommit:
    """The merge cursor, with the thread CPU of its COMMITs added up."""

    def __init__(self, cursor):
        self.cursor, self.commit_s = cursor, 0.0

    def execute(self, sql, *args):
        if sql != "COMMIT":
            return self.cursor.execute(sql, *args)
        began = time.thread_time()
        try:
            return self.cursor.execute(sql, *args)
        finally:
            self.commit_s += time.thread_time() - began

    def __getattr__(self, name):
        return getattr(self.cursor, name)


def run(columns: list, group: int, folder: Path) -> tuple[float, float]:
    """(merge CPU, COMMIT CPU) in microseconds per span, appending ``columns`` ``group`` at a time."""
    store = DuckDBStore(folder / f"merge-{group}.duckdb")
    store._journal.close()  # this benchmark merges by itself
    timed = store._merger = _TimedCommit(store._merger)
    spans, cpu, seq = 0, 0.0, 0
    try:
        for at in range(0, len(columns), group):
            entries = []
            for part in columns[at:at + group]:
                seq += 1
                entries.append(journal.Entry(seq, part, part.nbytes))
            began = time.thread_time()
            store._merge(entries)
            cpu += time.thread_time() - began
            spans += sum(part.spans for part in columns[at:at + group])
    finally:
        store._con.close()  # its journal is closed already, and holds nothing
    return cpu / spans * 1e6, timed.commit_s / spans * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=1200, help="engine batches of ~460 spans each")
    parser.add_argument("--groups", default="60,150", help="batches per merge, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    groups = [int(text) for text in args.groups.split(",")]
    columns = [dataclasses.replace(_parse(body), sources=None) for body, _ in make_bodies(3000, 512)[:args.batches]]
    spans = sum(part.spans for part in columns)
    print(f"{len(columns)} batches, {spans:,} engine spans; merges of {', '.join(str(g) for g in groups)} batches "
          f"({', '.join(f'~{spans * g // len(columns):,}' for g in groups)} spans), {args.rounds} rounds")
    results: dict[int, list[tuple[float, float]]] = {group: [] for group in groups}
    for _ in range(args.rounds):
        for group in groups:
            with tempfile.TemporaryDirectory() as tmp:
                results[group].append(run(columns, group, Path(tmp)))
    first = statistics.median(cpu for cpu, _ in results[groups[0]])
    for group in groups:
        cpu = statistics.median(value for value, _ in results[group])
        commit = statistics.median(value for _, value in results[group])
        each = ", ".join(f"{value:.2f}" for value, _ in results[group])
        print(f"  {group:4d} batches a merge: {cpu:6.2f} us/span merge CPU (rounds: {each}), COMMIT {commit:5.2f}; "
              f"ratio {cpu / first:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
