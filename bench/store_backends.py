"""Store backends side by side: DuckDB vs ClickHouse (chdb, in-process) in one run.

1. write(): engine-shaped OTLP (bench/synth.py) is normalized into groups of 50,000 spans (what the
   writer thread groups under load) and each group goes to both stores through the writer role.
   spans/s counts write() only; generating and normalizing are the same for both and reported apart.
2. Fill: generating and normalizing run at ~10-40k spans/s on this 2-core machine, too slow to build
   10M spans in minutes, so the store grows by copies of that pool, re-keyed in Arrow (ids suffixed,
   hashes XOR-salted, times shifted past the pool: fresh requests, same shape) and appended in bulk:
   the DuckDB store through its write role (journal and merge: what its writer does with a large
   group), ClickHouse with its bulk Arrow insert; bounded by --spans and --seconds (the run says the
   size reached).
3. Reads on the filled store: the reader role and the analyzers' named queries for random requests,
   p50/p99 per call on each backend (and the analyzers' verdicts when they are installed).
4. On-disk bytes per span: DuckDB's file after CHECKPOINT, ClickHouse's active parts.
5. A real collector process per backend over loopback (bench/ingest.py's driver), spans/s acked.

    python bench/store_backends.py [--spans 10000000] [--seconds 480] [--collector-seconds 15]
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from ingest import percentile
from synth import Workload

from tokentrace.collector import stores
from tokentrace.collector.decoding.columns import Columns
from tokentrace.collector.decoding.normalize import normalize
from tokentrace.collector.decoding.tables import PACKED
from tokentrace.collector.stores import sqlfiles
from tokentrace.collector.stores.store_clickhouse import _expand

BACKENDS = ("duckdb", "chdb")
GROUP_SPANS = 50_000  # what the writer thread groups under load (collector/stores/writer.py)
_IDS = {"request_id", "trace_id", "span_id", "parent_span_id", "entry_request_id", "evicted_by_request_id"}
_ID_LISTS = {"prefill_request_ids", "decode_request_ids"}
_TIMES = {"start_ns", "end_ns", "t_ns", "seen_ns"}
_HASHES = {"hash", "fingerprint", "matched_entry"}
_HASH_LISTS = {"hashes"}


def open_stores(tmp: Path) -> dict:
    """A fresh store of each backend under ``tmp``."""
    return {"duckdb": stores.open_store(stores.parse(f"duckdb://{tmp / 'bench.duckdb'}")),
            "chdb": stores.open_store(stores.parse(f"chdb://{tmp / 'chdb'}"))}


def make_pool(pool_spans: int, start_ns: int) -> tuple[list[Columns], float, Workload]:
    """Groups of normalized engine-shaped spans; (groups, seconds to generate + normalize, workload)."""
    workload = Workload(seed=3, instances=4, start_ns=start_ns)
    batches = workload.batches(512)
    groups, began = [], time.perf_counter()
    while sum(g.spans for g in groups) < pool_spans:
        parts = []
        while sum(part.spans for part in parts) < GROUP_SPANS:
            parts.append(normalize(next(batches)).columns())
        groups.append(Columns.concat(parts))
    return groups, time.perf_counter() - began, workload


def write_pool(opened: dict, groups: list[Columns]) -> dict[str, float]:
    """write() every group to every store (a copy each: a write changes its batch); seconds per
    backend, DuckDB's until its merge thread has appended the group."""
    seconds = dict.fromkeys(opened, 0.0)
    for group in groups:
        for backend, store in opened.items():
            began = time.perf_counter()
            store.write(Columns(dict(group.tables), dict(group.origin), group.keys, group.spans))
            if hasattr(store, "settle"):
                store.settle()
            seconds[backend] += time.perf_counter() - began
    return seconds


def pool_tables(groups: list[Columns]) -> dict[str, pa.Table]:
    """The pool as one Arrow table per table (packed tables packed)."""
    return Columns.concat(groups).tables


def rekey(table: pa.Table, cycle: int, shift_ns: int) -> pa.Table:
    """A copy of ``table`` as new requests: ids suffixed, hashes salted, times shifted."""
    suffix, salt = f"~{cycle}", (cycle * 0x9E3779B97F4A7C15) % (1 << 63)
    columns = []
    for name in table.column_names:
        column = table.column(name).combine_chunks()
        if name in _IDS:
            column = pc.binary_join_element_wise(column, suffix, "")
        elif name in _ID_LISTS:
            flat = pc.binary_join_element_wise(pc.list_flatten(column), suffix, "")
            column = pa.ListArray.from_arrays(column.offsets, flat)
        elif name in _TIMES:
            column = pc.add(column, shift_ns)
        elif name in _HASHES:
            column = pc.bit_wise_xor(column, pa.scalar(salt, pa.int64()))
        elif name in _HASH_LISTS:
            flat = pc.bit_wise_xor(pc.list_flatten(column), pa.scalar(salt, pa.int64()))
            column = pa.ListArray.from_arrays(column.offsets, flat)
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=table.schema)


def fill(opened: dict, tables: dict[str, pa.Table], pool_spans: int, shift_ns: int, target: int,
         seconds: float) -> tuple[int, dict[str, float]]:
    """Append re-keyed copies of the pool until ``target`` spans or ``seconds``; (spans, s per backend)."""
    spans, cycle, spent = pool_spans, 0, dict.fromkeys(opened, 0.0)
    began = time.perf_counter()
    while spans + pool_spans <= target and time.perf_counter() - began < seconds:
        cycle += 1
        copies = {table: rekey(data, cycle, cycle * shift_ns) for table, data in tables.items()}
        for backend, store in opened.items():
            t0 = time.perf_counter()
            bulk_insert(store, copies)
            spent[backend] += time.perf_counter() - t0
        spans += pool_spans
        print(f"  {spans:>11,} spans ({time.perf_counter() - began:.0f} s)", flush=True)
    return spans, spent


def bulk_insert(store, copies: dict[str, pa.Table]) -> None:
    """Each backend's bulk append: DuckDB's write role (journal, then one merge transaction),
    ClickHouse's Arrow insert (packed tables expanded, as its write() inserts them)."""
    if hasattr(store, "settle"):  # spans=0: fresh ids, nothing for the exactly-once check to look up
        store.write(Columns(copies, {name: np.zeros(t.num_rows, np.int32) for name, t in copies.items()}))
        store.settle()
    else:
        for table, data in copies.items():
            rows = _expand(table, data.cast(store._packed[table])) if table in PACKED else data
            store._writer.insert_arrow(table, rows, settings={"insert_deduplicate": 0})


def _param_names(name: str) -> list[str]:
    text = "\n".join(sqlfiles.statements(sqlfiles.read("duckdb", f"queries/{name}.sql")))
    return sorted(set(re.findall(r"\$([a-z_][a-z0-9_]*)", text)))


def calls_for(reference, request_id: str) -> dict:
    """{label: call(store)} for one request: the analyzers' verdicts, the reader role's methods, and
    every named query whose parameters follow from the request."""
    from tokentrace.analyzers.cache import analyze_cache, request_window
    from tokentrace.analyzers.report import summarize
    from tokentrace.analyzers.slowness import analyze_slowness

    row = reference.request(request_id)
    window = request_window(row)
    hashes = reference.frame("lookup_blocks", request_id=request_id, **window)["hash"].to_list()
    hour = 3_600_000_000_000
    known = {"request_id": request_id, "trace_id": row["trace_id"], "instance_id": row["instance_id"],
             "since_ns": row["start_ns"] - hour, "until_ns": row["start_ns"] + 1, "before_ns": row["start_ns"],
             **window, "limit": 1000, "sha256": "0" * 64, "hashes": hashes, "hash": hashes[-1] if hashes else 0,
             "fingerprints": [], "request_ids": [request_id], "load_id": "none"}
    calls = {"analyze slow": lambda s: analyze_slowness(s, request_id),
             "analyze cache": lambda s: analyze_cache(s, request_id),
             "report, 1 h window": lambda s: summarize(s, row["start_ns"] - hour, row["start_ns"]),
             "request()": lambda s: s.request(request_id), "trace()": lambda s: s.trace(known["trace_id"])}
    for name in sorted(sqlfiles.query_names("duckdb")):
        wanted = _param_names(name)
        if set(wanted) <= set(known):
            # A window of rows goes through the columnar path, as the dashboards read it.
            how = "bulk" if "since_ns" in wanted and "request_id" not in wanted else "frame"
            calls[name] = lambda s, n=name, w=wanted, h=how: getattr(s, h)(n, **{k: known[k] for k in w})
    return calls


def query_latency(opened: dict, request_ids: list[str]) -> dict[str, dict[str, list[float]]]:
    """{call: {backend: [seconds]}} over the given requests."""
    timings: dict[str, dict[str, list[float]]] = {}
    for request_id in request_ids:
        for label, call in calls_for(opened["duckdb"], request_id).items():
            for backend, store in opened.items():
                t0 = time.perf_counter()
                call(store)
                timings.setdefault(label, {}).setdefault(backend, []).append(time.perf_counter() - t0)
    return timings


def disk_bytes(opened: dict, tmp: Path) -> dict[str, int]:
    """Bytes on disk of each store's data (DuckDB after a checkpoint; ClickHouse active parts)."""
    opened["duckdb"]._con.execute("CHECKPOINT")
    [(parts,)] = opened["chdb"]._reader().query(
        "SELECT sum(bytes_on_disk) FROM system.parts WHERE database = currentDatabase() AND active").result_rows
    return {"duckdb": (tmp / "bench.duckdb").stat().st_size, "chdb": int(parts)}


def collector_rate(seconds: float) -> dict[str, float]:
    """Spans/s acknowledged by a real collector process per backend, 4 senders over loopback."""
    from harness_collector import CollectorProcess
    from ingest import drive, make_bodies

    bodies = make_bodies(60, 512)
    rates = {}
    for backend in BACKENDS:
        with tempfile.TemporaryDirectory() as tmp:
            store = None if backend == "duckdb" else f"chdb://{tmp}/chdb"
            collector = CollectorProcess(Path(tmp), store=store).start()
            try:
                acked, elapsed, latencies, _, _, errors = drive(collector.port, bodies, 4, seconds, 1_000_000)
            finally:
                collector.stop()
            rates[backend] = acked / elapsed
            print(f"  {backend:7} collector: {rates[backend]:,.0f} spans/s acknowledged, p99 "
                  f"{percentile(latencies, 0.99):.0f} ms ({errors} errors)")
    return rates


def _request_id(number: int, cycle: int) -> str:
    return f"req-{number:08d}" + (f"~{cycle}" if cycle else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=10_000_000, help="target store size in spans")
    parser.add_argument("--pool-spans", type=int, default=200_000, help="spans generated and written by write()")
    parser.add_argument("--seconds", type=float, default=480.0, help="bound on the fill phase")
    parser.add_argument("--rounds", type=int, default=30, help="random requests per call")
    parser.add_argument("--collector-seconds", type=float, default=15.0, help="0 skips the collector phase")
    args = parser.parse_args()

    start_ns = time.time_ns() - 24 * 3_600_000_000_000
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        opened = open_stores(tmp)
        try:
            groups, made_s, workload = make_pool(args.pool_spans, start_ns)
            pool = sum(g.spans for g in groups)
            print(f"pool: {pool:,} spans, {workload.count:,} requests on 4 instances "
                  f"(generate + normalize {pool / made_s:,.0f} spans/s, shared)")
            written = write_pool(opened, groups)
            for backend in BACKENDS:
                print(f"  {backend:7} write(): {pool / written[backend]:,.0f} spans/s "
                      f"({len(groups)} groups of ~{GROUP_SPANS:,})")
            tables = pool_tables(groups)
            shift = workload.clock - start_ns + 1_000_000_000
            del groups
            print(f"fill: re-keyed copies of the pool, up to {args.spans:,} spans or {args.seconds:.0f} s")
            spans, spent = fill(opened, tables, pool, shift, args.spans, args.seconds)
            filled = spans - pool
            note = "" if spans + pool > args.spans else f" (the {args.seconds:.0f} s bound stopped it)"
            print(f"store: {spans:,} spans in each backend{note}")
            for backend in BACKENDS:
                if filled:
                    print(f"  {backend:7} bulk Arrow insert: {filled / spent[backend]:,.0f} spans/s")
            sizes = disk_bytes(opened, tmp)
            for backend in BACKENDS:
                print(f"  {backend:7} on disk: {sizes[backend] / 2**20:,.1f} MiB, "
                      f"{sizes[backend] / spans:.1f} bytes/span")
            rng = random.Random(5)
            cycles = (spans // pool) - 1
            picks = [_request_id(rng.randrange(1, workload.count + 1), rng.randrange(cycles + 1))
                     for _ in range(args.rounds)]
            timings = query_latency(opened, picks)
            print(f"latency at {spans:,} spans over {args.rounds} random requests, ms (p50 / p99):")
            for label, per_backend in timings.items():
                cells = "   ".join(f"{b} {statistics.median(v) * 1e3:8.2f} / {percentile(v, 0.99):8.2f}"
                                   for b, v in per_backend.items())
                print(f"  {label:18} {cells}")
        finally:
            for store in opened.values():
                store.close()
    if args.collector_seconds > 0:
        print(f"collector over loopback, {args.collector_seconds:.0f} s per backend:")
        collector_rate(args.collector_seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
