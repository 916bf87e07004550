"""Span files benchmark: what storing a merge's spans in a Parquet file (collector/stores/span_files.py)
costs and saves against DuckDB's own table, measured side by side in one run.

Decodes engine-shaped batches (bench/synth.py, as bench/ingest.py sends them) and merges them
``--group`` at a time, as the merge thread does (``DuckDBStore._merge``), into two stores: one that
keeps every span in its table (``span_files.MIN_SPANS`` out of reach: the store before the files)
and one that writes a file a merge, its compaction held back. Then, for each store, the reads that
touch ``spans``: one trace (``trace.sql``, the request page), the writer's exact check of a batch of
late spans (``span_keys.sql``), a count, and the writer's key memory at start
(``span_key_minutes.sql``), median wall milliseconds of ``--reads`` each. Then the files are
compacted as the compaction thread does, level by level (``FANOUT`` files into one), each group
both rewritten (the way before) and joined (the way taken, collector/stores/parquet_concat.py), timed
(thread and process CPU: Arrow reads a file on threads of its own), and read again.

Prints the merge CPU a span of each store (thread CPU, the final ``CHECKPOINT`` included: DuckDB
runs on the calling thread with ``threads = 1``, the Parquet writer too) and their ratio, the
bytes a span on disk, each read's milliseconds, and each compaction's CPU a span.

    python bench/span_files.py [--batches 2400] [--group 60] [--reads 15] [--rounds 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from ingest import _parse, make_bodies
from merge import merge_all

from tokentrace.collector.stores import span_files
from tokentrace.collector.stores.store_duckdb import DuckDBStore

#: MIN_SPANS of the store that keeps every span in its table.
NEVER = 1 << 62


def _bytes(path: Path) -> int:
    total = path.stat().st_size
    folder = Path(str(path) + ".spans")
    if folder.exists():
        total += sum(p.stat().st_size for p in folder.iterdir())
    return total


def merged(columns: list, group: int, path: Path, files: bool) -> tuple[DuckDBStore, float]:
    """A store at ``path`` with ``columns`` merged ``group`` at a time (its journal and compaction
    stopped: this benchmark merges by itself) and the merge thread's CPU a span."""
    span_files.MIN_SPANS = span_files.MIN_SPANS if files else NEVER
    store = DuckDBStore(path)
    store._journal.close()
    store._span_files.close()
    spans, cpu = merge_all(store, columns, group)
    began = time.thread_time()
    store._con.execute("CHECKPOINT")  # what DuckDB left to compress and write, counted too
    cpu += time.thread_time() - began
    return store, cpu / spans * 1e6


def reads(store: DuckDBStore, late: list, count: int, seed: int) -> dict[str, float]:
    """Median wall ms of each read of ``spans`` (module docstring)."""
    cursor = store._thread_cursor()
    rng = random.Random(seed)
    traces = [t for (t,) in cursor.execute("SELECT DISTINCT trace_id FROM spans USING SAMPLE 200 ROWS").fetchall()]
    timings: dict[str, list[float]] = {"trace": [], "span_keys": [], "count": [], "span_key_minutes": []}
    starts = late.tables["spans"].column("start_ns").to_pylist()
    late_traces = late.tables["spans"].column("trace_id").to_pylist()
    for _ in range(count):
        for name, run in (("trace", lambda: store.rows("trace", trace_id=rng.choice(traces))),
                          ("span_keys", lambda: store._stored_keys(starts, late_traces)),
                          ("count", lambda: cursor.execute("SELECT count(*) FROM spans").fetchall()),
                          ("span_key_minutes", lambda: store._writer_frame("span_key_minutes"))):
            began = time.perf_counter()
            run()
            timings[name].append((time.perf_counter() - began) * 1000)
    return {name: statistics.median(values) for name, values in timings.items()}


def compact(store: DuckDBStore) -> tuple[int, dict[str, tuple[float, float]]]:
    """Compact ``store``'s files as its compaction thread would, to the top level: the number of
    compactions, and for each way of compacting a group (``rewrite``: every row group read and
    written again, the way before; ``join``: the files' bytes copied under one footer, the way
    taken, including the syncs) the thread and process CPU us a span compacted. Each group is
    rewritten into a scratch file first, then joined and swapped in."""
    files = store._span_files
    files._stopping = False
    done, spans = 0, 0
    cpu = {"rewrite": [0.0, 0.0], "join": [0.0, 0.0]}
    while True:
        group = files._group()
        if group is None:
            return done, {how: (t / max(spans, 1) * 1e6, p / max(spans, 1) * 1e6) for how, (t, p) in cpu.items()}
        scratch = files.folder / "scratch.parquet"
        t0, p0 = time.thread_time(), time.process_time()
        span_files.rewrite([files.folder / f.name for f in group], scratch, lambda: False)
        cpu["rewrite"][0] += time.thread_time() - t0
        cpu["rewrite"][1] += time.process_time() - p0
        scratch.unlink()
        t0, p0 = time.thread_time(), time.process_time()
        new = files._compact(group)
        after = [f for f in files.files if f not in group] + [new]
        with files.lock:
            store._swap_span_files(group, new, after)
            files.files = after
        cpu["join"][0] += time.thread_time() - t0
        cpu["join"][1] += time.process_time() - p0
        spans += new.spans
        done += 1
        for f in group:
            (files.folder / f.name).unlink()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=2400, help="engine batches of ~460 spans each")
    parser.add_argument("--group", type=int, default=60, help="batches a merge")
    parser.add_argument("--reads", type=int, default=15, help="times each read runs (median)")
    parser.add_argument("--rounds", type=int, default=1, help="both stores built this many times, in turn")
    args = parser.parse_args()
    bodies = make_bodies(6000, 512)
    decoded = [dataclasses.replace(_parse(body), sources=None) for body, _ in bodies[:args.batches]]
    late = _parse(bodies[args.batches // 2][0])  # spans the stores hold: a resend, checked exactly
    spans = sum(part.spans for part in decoded)
    print(f"{len(decoded)} batches, {spans:,} engine spans, merges of {args.group} batches "
          f"(~{spans * args.group // len(decoded):,} spans); {args.rounds} rounds")
    minimum, fanout = span_files.MIN_SPANS, span_files.FANOUT
    cpu: dict[str, list[float]] = {"table": [], "files": []}
    for turn in range(args.rounds):
        order = ("table", "files") if turn % 2 == 0 else ("files", "table")
        with tempfile.TemporaryDirectory() as tmp:
            for how in order:
                span_files.MIN_SPANS, span_files.FANOUT = minimum, fanout
                store, merge_cpu = merged(decoded, args.group, Path(tmp) / f"{how}.duckdb", how == "files")
                cpu[how].append(merge_cpu)
                size = _bytes(Path(store.path)) / spans
                listed = len(store._span_files.files)
                before = reads(store, late, args.reads, turn)
                print(f"round {turn + 1} {how:5s}: merge {merge_cpu:5.2f} us/span, {size:5.1f} bytes a span on disk, "
                      f"{listed} files; reads (ms) " + ", ".join(f"{k} {v:.1f}" for k, v in before.items()))
                if how == "files":
                    done, ways = compact(store)
                    after = reads(store, late, args.reads, turn)
                    size = _bytes(Path(store.path)) / spans
                    print(f"        compacted: {done} compactions to {len(store._span_files.files)} files, "
                          f"{size:.1f} bytes a span; reads (ms) " + ", ".join(f"{k} {v:.1f}" for k, v in after.items()))
                    print("        compaction CPU a span compacted, thread/process (us): " + ", ".join(
                        f"{how} {thread:.3f}/{process:.3f}" for how, (thread, process) in ways.items())
                        + f"; join/rewrite {ways['join'][1] / ways['rewrite'][1]:.3f}")
                store._con.close()
    table, files = statistics.median(cpu["table"]), statistics.median(cpu["files"])
    print(f"merge CPU a span, medians: table {table:.2f}, files {files:.2f} us; ratio {files / table:.3f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("POLARS_MAX_THREADS", "1")
    raise SystemExit(main())
