"""Analyzer benchmark: verdict and report latency on a large store built through the normalizer.

Builds (once, cached under .cache/) a DuckDB store from generated engine-shaped OTLP (bench/synth.py)
across 4 instances: the first BASE_CHUNKS chunks of 2,000 requests through the real normalizer and
writer, the rest as replicas of them (other ids, later times, unrelated prefixes) copied in SQL, which
``--check-build`` shows stores the same rows as ingesting them (1M requests: minutes, not hours).
Then measures:
- ``analyze slow`` and ``analyze cache`` query time for random requests (in-process, warm);
- CLI wall time of ``tokentrace analyze slow|cache --db FILE --json`` including Python start-up, and
  of the same through a collector serving the file (``--url``), next to the floors measured in the
  same run: ``python -c pass``, ``python -c "import _duckdb"`` (all a ``--db`` verdict imports of its
  libraries: DuckDB's engine module), ``import duckdb`` (its Python package) and ``import duckdb,
  polars, pyarrow``;
- ``analyze report --since 1h`` query time and CLI wall time;
and prints the store size on disk and bytes per span. Every figure is given as wall time and as CPU
time (of this process, or of the CLI child): on a shared machine wall time measures the neighbours
as much as the code, CPU time much less so.

    python bench/analyze.py [--requests 200000] [--samples 20] [--rebuild] [--base-chunks 20]
    python bench/analyze.py --check-build --requests 10000 --base-chunks 2
"""

from __future__ import annotations

import argparse
import compileall
import json
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

import duckdb
from synth import Workload, salt_of

from tokentrace import contract as c
from tokentrace.analyzers.cache import analyze_cache
from tokentrace.analyzers.report import summarize
from tokentrace.analyzers.slowness import analyze_slowness
from tokentrace.collector.decoding.normalize import Batch, normalize
from tokentrace.collector.stores import span_files
from tokentrace.collector.stores.store_duckdb import DuckDBStore, _attach

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"
CHUNK = 2000  # requests per generation task
START_NS = 1_790_000_000_000_000_000
#: Chunks generated through the normalizer and writer; chunk k >= BASE_CHUNKS is replica
#: k // BASE_CHUNKS of chunk k % BASE_CHUNKS (synth.Workload's ``replica``), written by copying
#: that chunk's stored rows in SQL (``replicate``), which ``--check-build`` shows equals ingesting it.
BASE_CHUNKS = 20
#: Columns a replica rewrites, by name (every other column is copied as stored).
_TIMES = {"start_ns", "end_ns", "t_ns", "seen_ns"}
_IDS = {"trace_id", "span_id", "parent_span_id"}
_REQUEST_IDS = {"request_id", "entry_request_id", "evicted_by_request_id"}
_REQUEST_ID_LISTS = {"prefill_request_ids", "decode_request_ids"}
_HASHES = {"hash", "fingerprint", "matched_entry", "fresh_hash"}
_HASH_LISTS = {"hashes"}
_NOT_COPIED = {"schema_migrations", "spool_files", "journal_state", "span_files"}


def _workload(chunk: int, base: int) -> Workload:
    first = chunk * CHUNK
    workload = Workload(seed=(chunk % base) * CHUNK, instances=4, start_ns=START_NS + first * 20_000_000,
                        replica=chunk // base)
    workload.count = first
    return workload


def _generate(task: tuple[int, int]) -> Batch:
    """Chunk ``chunk`` of the workload (CHUNK requests and the last batch's overshoot), normalized
    (runs in a worker process)."""
    chunk, base = task
    workload = _workload(chunk, base)
    merged = Batch()
    batches = workload.batches(512)
    while workload.count < (chunk + 1) * CHUNK:
        merged.extend(normalize(next(batches)))
    return merged


def _tables(con: duckdb.DuckDBPyConnection) -> dict[str, list[str]]:
    """The columns of every stored table (not the views over them)."""
    rows = con.execute("SELECT c.table_name, c.column_name FROM information_schema.columns c "
                       "JOIN information_schema.tables t USING (table_schema, table_name) "
                       "WHERE t.table_type = 'BASE TABLE' ORDER BY c.table_name, c.ordinal_position").fetchall()
    tables: dict[str, list[str]] = {}
    for table, column in rows:
        if table not in _NOT_COPIED:
            tables.setdefault(table, []).append(column)
    return tables


def build(path: Path, requests: int, base: int = BASE_CHUNKS, replicate: bool = True) -> float:
    """Write the store (``replicate``: the base chunks through the normalizer and writer, the rest
    copied in SQL; else every chunk through the normalizer and writer); returns seconds taken."""
    began = time.perf_counter()
    chunks = max(1, -(-requests // CHUNK))
    base = min(base, chunks)
    ingested = base if replicate else chunks
    # Every span in the table span_rows, none in span files (collector/stores/span_files.py): a replica
    # copies the stored rows of its chunk in SQL, and the verdicts measured here read no span.
    span_files.MIN_SPANS = 1 << 62
    store = DuckDBStore(path)
    ends = []  # per ingested chunk: rows per table once it is written (rowid ranges of its rows)
    with multiprocessing.get_context("spawn").Pool(max(1, (multiprocessing.cpu_count() or 2))) as pool:
        for done, batch in enumerate(pool.imap(_generate, [(k, base) for k in range(ingested)]), start=1):
            store.write(batch)
            if replicate:
                store.settle()  # the journaled batch is in the tables (collector/stores/journal.py)
                con = store._con
                ends.append({t: con.execute(f"SELECT count(*) FROM {t}").fetchall()[0][0] for t in _tables(con)})
            if done % 10 == 0:
                print(f"  {done * CHUNK:,} requests written through the normalizer", flush=True)
    store.close()
    if replicate and chunks > base:
        _replicate(path, base, chunks, ends)
    return time.perf_counter() - began


def _column(table: str, column: str) -> str:
    """The SQL of one column of a replica's row (parameters $offset, $shift, $salt, $prefix)."""
    if column in _TIMES:
        return f"{column} + $shift"
    if column in _IDS:
        return f"$prefix || substr({column}, 5)"
    if column in _REQUEST_IDS:
        return f"rid({column}, $offset)"
    if column in _REQUEST_ID_LISTS:
        return f"list_transform({column}, lambda x: rid(x, $offset))"
    if column in _HASHES:
        return f"xor({column}, $salt)"
    if column in _HASH_LISTS:
        return f"list_transform({column}, lambda x: xor(x, $salt))"
    if (table, column) == ("spans", "attributes"):  # the JSON repeats the request id and entry fingerprint
        rid_key, fp_key = json.dumps(c.REQUEST_ID) + ":", json.dumps(c.ENTRY_FINGERPRINT) + ":"
        fp = f"CAST(json_extract_string(attributes, '$.\"{c.ENTRY_FINGERPRINT}\"') AS BIGINT)"
        text = (f"replace(attributes, '{rid_key}\"' || request_id || '\"', "
                f"'{rid_key}\"' || rid(request_id, $offset) || '\"')")
        text = f"CASE WHEN request_id IS NULL THEN attributes ELSE {text} END"
        return (f"CASE WHEN {fp} IS NULL THEN {text} "
                f"ELSE replace({text}, '{fp_key}' || {fp}, '{fp_key}' || xor({fp}, $salt)) END")
    return column


def _replicate(path: Path, base: int, chunks: int, ends: list[dict[str, int]]) -> None:
    """Append replicas 1.. of the base chunks by copying their rows (see BASE_CHUNKS)."""
    con = _attach(str(path), read_only=False)  # as the store attaches it: its row group size
    con.execute("CREATE TEMP MACRO rid(x, o) AS CASE WHEN regexp_full_match(x, 'req-[0-9]{8}') "
                "THEN 'req-' || lpad(CAST(CAST(substr(x, 5) AS BIGINT) + o AS VARCHAR), 8, '0') ELSE x END")
    tables = _tables(con)
    for replica in range(1, -(-chunks // base)):
        copied = min(base, chunks - replica * base)
        params = {"offset": replica * base * CHUNK, "shift": replica * base * CHUNK * 20_000_000,
                  "salt": salt_of(replica), "prefix": f"{replica:04x}"}
        con.execute("BEGIN")
        for table, columns in tables.items():
            rows = ends[copied - 1][table]
            if rows:
                select = ", ".join(_column(table, column) for column in columns)
                used = {k: v for k, v in params.items() if f"${k}" in select}
                con.execute(f"INSERT INTO {table} SELECT {select} FROM {table} WHERE rowid < {rows} ORDER BY rowid",
                            used)
        con.execute("COMMIT")
        print(f"  {(replica * base + copied) * CHUNK:,} requests written (replica {replica} copied)", flush=True)
    con.execute("CHECKPOINT")
    con.close()


def check_build(requests: int, base: int) -> int:
    """Build the store both ways in a temporary directory and compare every table (as multisets of
    rows) and the verdicts of sampled requests; 0 when they are equal."""
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        slow_path, fast_path = Path(tmp) / "ingested.duckdb", Path(tmp) / "copied.duckdb"
        print(f"check: {requests:,} requests, {base} base chunks; every chunk through the normalizer ...")
        print(f"  {build(slow_path, requests, base, replicate=False):.1f} s")
        print("check: base chunks through the normalizer, the rest copied ...")
        print(f"  {build(fast_path, requests, base):.1f} s")
        con = duckdb.connect(str(slow_path), read_only=True)
        con.execute(f"ATTACH '{fast_path}' AS fast (READ_ONLY)")
        differ = 0
        for table in _tables(con):
            rows = con.execute(f"SELECT count(*) FROM {table}").fetchall()[0][0]
            apart = [con.execute(f"SELECT count(*) FROM (SELECT * FROM {a} EXCEPT ALL SELECT * FROM {b})")
                     .fetchall()[0][0] for a, b in ((table, f"fast.{table}"), (f"fast.{table}", table))]
            differ += sum(apart)
            print(f"  {table:<18} {rows:>10,} rows; only ingested {apart[0]:,}, only copied {apart[1]:,}")
        ids = [row[0] for row in con.execute("SELECT request_id FROM requests").fetchall()]
        con.close()
        stores = DuckDBStore(slow_path, read_only=True), DuckDBStore(fast_path, read_only=True)
        sample = random.Random(5).sample(ids, min(200, len(ids)))
        verdicts = sum(analyze(stores[0], rid).as_dict() != analyze(stores[1], rid).as_dict()
                       for rid in sample for analyze in (analyze_cache, analyze_slowness))
        for store in stores:
            store.close()
        print(f"  verdicts of {len(sample)} requests (cache and slow): {verdicts} differ")
        return 1 if differ or verdicts else 0


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
    parser.add_argument("--base-chunks", type=int, default=BASE_CHUNKS,
                        help=f"chunks of {CHUNK} requests built through the normalizer; the rest are copies "
                             f"(default {BASE_CHUNKS})")
    parser.add_argument("--check-build", action="store_true",
                        help="build --requests both ways (all through the normalizer; copies) and compare")
    args = parser.parse_args()

    CACHE.mkdir(exist_ok=True)
    if args.check_build:
        return check_build(args.requests, args.base_chunks)
    path = CACHE / f"bench-analyze-{args.requests}-b{args.base_chunks}.duckdb"
    if args.rebuild or not path.exists():
        path.unlink(missing_ok=True)
        print(f"building a store of {args.requests:,} requests ({args.base_chunks} chunks of {CHUNK} through "
              "the normalizer, the rest copies of them) ...")
        print(f"  built in {build(path, args.requests, args.base_chunks):.0f} s")
    DuckDBStore(path).close()  # a cached store written by an earlier version: its migrations applied
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
    # An installed package brings its bytecode (pip compiles it); an editable checkout, or a shell with
    # PYTHONDONTWRITEBYTECODE, would have each CLI child compile our modules again (~30 ms measured).
    for folder in ("core", "collector", "analyzers", "dashboards", "engine_shim"):
        compileall.compile_dir(ROOT / folder, quiet=1)
    runs = min(20, len(sample))
    line("python -c pass (floor)", [_child("-c", "pass") for _ in range(runs)], 300)
    line("import _duckdb (floor of --db)", [_child("-c", "import _duckdb") for _ in range(runs)], 300)
    line("import duckdb (its package)", [_child("-c", "import duckdb") for _ in range(runs)], 300)
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
