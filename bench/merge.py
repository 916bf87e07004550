"""Merge benchmark: the CPU the DuckDB store's merge thread spends per engine span, by merge size.

Decodes engine-shaped batches (bench/synth.py, as bench/ingest.py sends them) and appends them to
fresh stores the way the merge thread does (``DuckDBStore._merge``: every table in one transaction,
the journal's sequence number with them), ``--groups`` batches per merge, each size into a store of
its own and the sizes taken in turn, round after round, so that a host whose speed drifts (this
project's VM: up to 2x within an hour) moves every size alike. Prints, per size, the merge thread's
CPU per span (``time.thread_time``: DuckDB runs its work on the calling thread with ``threads = 1``),
how much of it the COMMIT (DuckDB's checkpoints among them) and the first-new-block frontiers
(collector/stores/frontier.py) took, and each size's ratio to the first. DuckDB's memory is bounded as the
collector bounds it (``--memory-limit``, the collector's default): a checkpoint costs more under it.
A checkpoint comes once 256 MB of rows went through DuckDB's WAL, which merges of this size seldom
fill: a table's rows of one merge bypass the WAL when they fill a row group
(store_duckdb.ROW_GROUP_SIZE); what the checkpoints cost a collector under load, ``bench/ab.py``
measures (docs/benchmarks.md, Issue 17, twenty-third round).

``--spans`` measures what the ``spans`` rows cost the merge, beside the store as it is (``all``: a
merge of ``span_files.MIN_SPANS`` or more writes them to a Parquet file, collector/stores/span_files.py):
``table`` appends every row to DuckDB's table as the store did before the span files, ``lean``
gives it every row with ``attributes`` and ``resource`` empty (NULL), ``none`` no rows at all (the
typed tables as they are). ``lean`` and ``none`` are not what the store may keep (what a sender
sent is stored as sent): they bound what a leaner row for contract spans could save
(docs/benchmarks.md, Issue 17, seventeenth round). Each variant's rows are prepared before its
merges are timed; the span files are not compacted (bench/span_files.py measures that).

    python bench/merge.py [--batches 3000] [--groups 60,150] [--rounds 3] [--memory-limit BYTES]
                          [--spans all,table,lean,none]
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

import pyarrow as pa
from ingest import _parse, make_bodies

from tokentrace.collector.settings import SETTINGS
from tokentrace.collector.stores import frontier, journal, span_files
from tokentrace.collector.stores.store_duckdb import DuckDBStore

#: Thread CPU seconds of the frontiers (the store calls frontier.fresh_frontiers in each merge).
_FRONTIER_S = [0.0]
_fresh_frontiers = frontier.fresh_frontiers


def _timed_frontiers(*args):
    began = time.thread_time()
    try:
        return _fresh_frontiers(*args)
    finally:
        _FRONTIER_S[0] += time.thread_time() - began


frontier.fresh_frontiers = _timed_frontiers  # the module store_duckdb imports when a store opens
#: The collector's bound on DuckDB's memory (--store-memory-bytes).
COLLECTOR_MEMORY = next(setting.default for setting in SETTINGS if setting.name == "store_memory_bytes")


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


#: What a merge gives the ``spans`` table (``--spans``, module docstring).
SPANS_VARIANTS = ("all", "table", "lean", "none")
#: The columns ``lean`` leaves empty: a contract span's attribute and resource objects.
_LEAN_EMPTY = ("attributes", "resource")


def spans_as(columns, how: str):
    """``columns`` with its ``spans`` rows as ``how`` says (``SPANS_VARIANTS``); the rest unchanged."""
    if how in ("all", "table"):
        return columns
    tables = dict(columns.tables)
    if how == "none":
        tables.pop("spans", None)
    elif "spans" in tables:
        spans = tables["spans"]
        for name in _LEAN_EMPTY:
            at = spans.schema.get_field_index(name)
            field = spans.schema.field(at)
            spans = spans.set_column(at, field, pa.nulls(spans.num_rows, field.type))
        tables["spans"] = spans
    return dataclasses.replace(columns, tables=tables)


def merge_all(store: DuckDBStore, columns: list, group: int) -> tuple[int, float]:
    """Merge ``columns`` into ``store`` ``group`` at a time as its merge thread does, on this
    thread: (spans, thread CPU seconds of the merges)."""
    spans, cpu, seq = 0, 0.0, 0
    for at in range(0, len(columns), group):
        entries = []
        for part in columns[at:at + group]:
            seq += 1
            entries.append(journal.Entry(seq, part, part.nbytes))
        began = time.thread_time()
        store._merge(entries)
        cpu += time.thread_time() - began
        spans += sum(part.spans for part in columns[at:at + group])
    return spans, cpu


def run(columns: list, group: int, folder: Path, memory_limit: int, table: bool = False) -> tuple[float, float, float]:
    """(merge CPU, COMMIT CPU, frontier CPU) in microseconds per span, appending ``columns``
    ``group`` at a time (``table``: every span to DuckDB's table, none to a span file)."""
    store = DuckDBStore(folder / f"merge-{group}.duckdb")
    store._journal.close()  # this benchmark merges by itself
    store._span_files.close()  # and compacts nothing
    store.limit_memory(memory_limit)
    minimum = span_files.MIN_SPANS
    span_files.MIN_SPANS = 1 << 62 if table else minimum
    timed = store._merger = _TimedCommit(store._merger)
    _FRONTIER_S[0] = 0.0
    try:
        spans, cpu = merge_all(store, columns, group)
    finally:
        span_files.MIN_SPANS = minimum
        store._con.close()  # its journal is closed already, and holds nothing
    return cpu / spans * 1e6, timed.commit_s / spans * 1e6, _FRONTIER_S[0] / spans * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=3000, help="engine batches of ~460 spans each")
    parser.add_argument("--groups", default="60,150", help="batches per merge, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-limit", type=int, default=COLLECTOR_MEMORY,
                        help="DuckDB's memory_limit in bytes (default: the collector's --store-memory-bytes)")
    parser.add_argument("--spans", default="all",
                        help=f"what the spans table gets, comma-separated from {', '.join(SPANS_VARIANTS)}")
    args = parser.parse_args()
    groups = [int(text) for text in args.groups.split(",")]
    variants = args.spans.split(",")
    if unknown := sorted(set(variants) - set(SPANS_VARIANTS)):
        parser.error(f"--spans takes {', '.join(SPANS_VARIANTS)}, not {', '.join(unknown)}")
    decoded = [dataclasses.replace(_parse(body), sources=None) for body, _ in make_bodies(3000, 512)[:args.batches]]
    spans = sum(part.spans for part in decoded)
    print(f"{len(decoded)} batches, {spans:,} engine spans; merges of {', '.join(str(g) for g in groups)} batches "
          f"({', '.join(f'~{spans * g // len(decoded):,}' for g in groups)} spans), spans rows: "
          f"{', '.join(variants)}; {args.rounds} rounds")
    cases = [(group, how) for group in groups for how in variants]
    results: dict[tuple[int, str], list[tuple[float, float, float]]] = {case: [] for case in cases}
    for turn in range(args.rounds):
        for group, how in cases if turn % 2 == 0 else cases[::-1]:  # drift moves every case alike
            columns = [spans_as(part, how) for part in decoded]
            with tempfile.TemporaryDirectory() as tmp:
                results[group, how].append(run(columns, group, Path(tmp), args.memory_limit, how == "table"))
    first = statistics.median(cpu for cpu, _, _ in results[cases[0]])
    for group, how in cases:
        cpu, commit, frontiers = (statistics.median(values) for values in zip(*results[group, how], strict=True))
        each = ", ".join(f"{value:.2f}" for value, _, _ in results[group, how])
        print(f"  {group:4d} batches a merge, spans {how:4s}: {cpu:6.2f} us/span merge CPU (rounds: {each}), "
              f"COMMIT {commit:5.2f}, frontiers {frontiers:5.2f}; ratio {cpu / first:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
