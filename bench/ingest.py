"""Ingest benchmark: a real collector over loopback vs the raw ceiling on the same machine.

Drives ``tokentrace collector`` with OTLP protobuf batches of 512 engine-shaped spans (bench/synth.py;
``--shape light`` sends small generic spans instead)
from 4 concurrent senders, bounded in requests and seconds, and prints spans/s persisted (journaled
before the acknowledgement, collector/stores/journal.py), export requests/s and LLM requests/s (llm.request
spans), p50/p99 request latency, how long after the last acknowledgement everything was in the
tables, and the raw ceiling measured in the same run: the parse stage (collector/receiver/ingest.py's
``parse``, the compiled decoder where it applies) and the store's write role (journal, then merge)
in one thread plus the store's merge thread, no HTTP, no queue.

    python bench/ingest.py [--seconds 20] [--senders 4] [--spans-per-batch 512]
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import math
import multiprocessing
import os
import pickle
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness_collector import CollectorProcess
from synth import Workload, light_batches

from tokentrace.collector.decoding.columns import Columns
from tokentrace.collector.receiver.ingest import parse
from tokentrace.collector.receiver.otlp import PROTOBUF, Encoding
from tokentrace.collector.stores.store_duckdb import DuckDBStore
from tokentrace.errors import Overloaded

_PROTOBUF = Encoding("protobuf", PROTOBUF)


def _parse(body: bytes) -> Columns:
    return parse(body, _PROTOBUF, None, 64 << 20, 65_536)


CACHE = Path(__file__).resolve().parents[1] / ".cache"
#: Batches per generation task: each task is a workload of its own seed (other sessions, ids).
_CHUNK = 100


def _generate(task: tuple[str, int, int, int]) -> list[tuple[bytes, int]]:
    shape, seed, count, spans_per_batch = task
    batches = (Workload(seed=seed, full_histories=shape == "engine-full").batches(spans_per_batch)
               if shape.startswith("engine") else light_batches(spans_per_batch, seed=seed))
    bodies = []
    for _ in range(count):
        request = next(batches)
        spans = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        bodies.append((request.SerializeToString(), spans))
    return bodies


def make_bodies(count: int, spans_per_batch: int, shape: str = "engine") -> list[tuple[bytes, int]]:
    """(serialized request, span count) pairs, generated before any timing starts: in chunks of
    ``_CHUNK`` batches on every core, each chunk a workload of its own seed, and kept in .cache/
    one file a chunk (generating costs ~0.1 s a batch, longer than a run at 100k spans/s needs
    batches for; a longer run generates only the chunks it adds, and loads no file whole twice).
    Returned in the order of their span times (``in_time_order``)."""
    tasks = [(shape, 11 + k, min(_CHUNK, count - at), spans_per_batch) for k, at in enumerate(range(0, count, _CHUNK))]
    if len(tasks) <= 1:
        return _generate(tasks[0]) if tasks else []
    folder = CACHE / f"ingest-{shape}-{spans_per_batch}"
    paths = [folder / f"seed{seed}x{n}.pickle" for _, seed, n, _ in tasks]
    missing = [(task, path) for task, path in zip(tasks, paths, strict=True) if not path.exists()]
    if missing:
        folder.mkdir(parents=True, exist_ok=True)
        with multiprocessing.get_context("spawn").Pool() as pool:
            for (_, path), chunk in zip(missing, pool.imap(_generate, [task for task, _ in missing]), strict=True):
                partial = path.with_suffix(".partial")
                partial.write_bytes(pickle.dumps(chunk))
                partial.rename(path)  # a run stopped while generating leaves no truncated chunk
    return in_time_order([body for path in paths for body in pickle.loads(path.read_bytes())])


def in_time_order(bodies: list) -> list:
    """The chunks' batches interleaved: the first of each chunk, then the second of each, and so on.
    Every chunk's workload starts at the same instant (synth.Workload's clock), so chunk after
    chunk replayed the same two minutes of span times again and again: past the writer's memory of
    span keys (collector/stores/once.py, 4M spans) every later span was late data, looked up in the store
    (a 90 s run fell to 9.5-9.9k spans/s past 4M spans). Interleaved, batches arrive in the order of their
    times, as the spans of many engines running at once do."""
    chunks = [bodies[at:at + _CHUNK] for at in range(0, len(bodies), _CHUNK)]
    return [chunk[i] for i in range(_CHUNK) for chunk in chunks if i < len(chunk)]


def _cpu_of(stat: Path) -> float:
    """User + system CPU seconds in a /proc ``stat`` file (a process's or a thread's)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by process ``pid`` and its descendants alive now
    (Linux /proc; None elsewhere): what a run costs, whatever else loads a shared machine."""
    total, pending = 0.0, [pid]
    try:
        while pending:
            current = pending.pop()
            total += _cpu_of(Path(f"/proc/{current}/stat"))
            for task in Path(f"/proc/{current}/task").iterdir():
                pending.extend(int(child) for child in (task / "children").read_text().split())
    except (OSError, ValueError, IndexError):
        return None
    return total


def thread_times(pid: int) -> dict[str, list[float]] | None:
    """Per thread of process ``pid`` by its system name (core/threads.py; a pool's ``_N`` dropped,
    the main thread as ``main``): [threads, CPU seconds, seconds runnable but waiting for a core
    (``/proc/PID/task/TID/schedstat``)]. None where /proc has none."""
    found: dict[str, list[float]] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            name = "main" if task.name == str(pid) else (task / "comm").read_text().strip()
            cpu = _cpu_of(task / "stat")
            waiting = int((task / "schedstat").read_text().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
        group = found.setdefault(re.sub(r"_\d+$", "", name), [0, 0.0, 0.0])
        for at, value in enumerate((1, cpu, waiting)):
            group[at] += value
    return found


def thread_deltas(before: dict[str, list[float]], after: dict[str, list[float]],
                  seconds: float) -> list[tuple[float, float, str]]:
    """Between two ``thread_times`` ``seconds`` apart, busiest first: (CPU seconds, the share of
    the time each thread was runnable but waiting for a core, name with its count of threads)."""
    rows = []
    for name, (count, cpu, waiting) in after.items():
        _, cpu_before, waiting_before = before.get(name, [0, 0.0, 0.0])
        rows.append((cpu - cpu_before, (waiting - waiting_before) / seconds / count,
                     f"{name} (x{count})" if count > 1 else name))
    return sorted(rows, reverse=True)


def thread_report(before: dict[str, list[float]], after: dict[str, list[float]], spans: int, seconds: float) -> str:
    """``thread_deltas`` in one line: µs of CPU a span of each thread that took at least 0.1."""
    return ", ".join(f"{name} {cpu / spans * 1e6:.1f} us ({waited:.0%} waiting)"
                     for cpu, waited, name in thread_deltas(before, after, seconds) if cpu / spans * 1e6 >= 0.1)


def raw_ceiling(bodies: list[tuple[bytes, int]], seconds: float, group: int = 4) -> tuple[float, float]:
    """Spans/s for parse + journal + merge (the store's merge thread beside this one), no HTTP; and
    the CPU seconds per span that took (every thread of this process, DuckDB's included)."""
    with tempfile.TemporaryDirectory() as tmp:
        store = DuckDBStore(Path(tmp) / "raw.duckdb")
        store.write(_parse(bodies[-1][0]))  # warm: first-call costs
        store.settle()
        bodies = bodies[:-1]
        spans, start, cpu = 0, time.perf_counter(), time.process_time()
        index = 0
        while time.perf_counter() - start < seconds and index + group <= len(bodies):
            merged = Columns.concat([_parse(body) for body, _ in bodies[index:index + group]])
            index += group  # never wraps: a batch written again would be a resend, stored once
            while True:
                try:
                    store.write(merged)
                    break
                except Overloaded:  # the merge fell a journal's bound behind: wait for it, as a sender does
                    store.settle()
            spans += merged.spans
        store.settle()  # everything in the tables
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        store.close()
    return spans / elapsed, cpu / spans


def drive(port: int, bodies: list[tuple[bytes, int]], senders: int, seconds: float, max_requests: int):
    """Post bodies from ``senders`` threads, each as an OTLP exporter does: a batch refused with 503
    is sent again after the collector's Retry-After (at most 1 s), not dropped. Returns (acked spans,
    elapsed, latencies of acknowledged requests, latencies of acknowledged exports from their first
    attempt, refusals, other errors)."""
    latencies: list[float] = []
    exports: list[float] = []
    acked, refused, errors, exhausted = [0], [0], [0], [False]
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds
    sent = [0]

    def export(conn: http.client.HTTPConnection, body: bytes, spans: int) -> bool:
        """Send one batch until it is acknowledged, refused for good or the time is up; False once
        the request bound is reached."""
        first = time.perf_counter()
        while time.perf_counter() < deadline:
            with lock:
                if sent[0] >= max_requests:
                    return False
                sent[0] += 1
            began = time.perf_counter()
            conn.request("POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf"})
            response = conn.getresponse()
            response.read()
            took = time.perf_counter() - began
            with lock:
                if response.status == 200:
                    acked[0] += spans
                    latencies.append(took)
                    exports.append(time.perf_counter() - first)
                    return True
                if response.status != 503:
                    errors[0] += 1
                    return True
                refused[0] += 1
            # The collector's instruction, as an OTLP exporter follows it.
            time.sleep(min(1.0, float(response.getheader("Retry-After") or 1)))
        return True

    def sender(offset: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        # Each distinct batch once: a repeat would be a resend, stored once (collector/stores/once.py).
        for body, spans in bodies[offset::senders]:
            if time.perf_counter() >= deadline or not export(conn, body, spans):
                break
        else:
            with lock:
                exhausted[0] |= time.perf_counter() < deadline and sent[0] < max_requests
        conn.close()

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(senders)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if exhausted[0]:
        print("  note: every distinct batch was sent before the time was up (a repeat would be a resend, "
              "stored once); raise --distinct-batches for a longer run")
    return acked[0], time.perf_counter() - start, latencies, exports, refused[0], errors[0]


def wait_merged(collector) -> float:
    """Wait until a collector's journal is merged into its tables; returns the seconds waited."""
    began = time.perf_counter()
    while collector.health()["journal"]["unmerged_batches"]:
        time.sleep(0.01)  # polling the collector's own count: nothing else to wait on
    return time.perf_counter() - began


def percentile(values: list[float], share: float) -> float:
    """The value at ``share`` of the sorted ``values`` (seconds), in milliseconds (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))] * 1000 if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each measured phase")
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--spans-per-batch", type=int, default=512)
    parser.add_argument("--max-requests", type=int, default=20_000, help="upper bound on requests sent")
    parser.add_argument("--distinct-batches", type=int, default=3000,
                        help="batches generated up front (cached in .cache/: a repeat would be a resend, stored once)")
    parser.add_argument("--shape", choices=("engine", "light"), default="engine",
                        help="engine: the shim's spans (arrays of offsets and hashes); light: small generic spans")
    args = parser.parse_args()

    print(f"{args.distinct_batches} batches of ~{args.spans_per_batch} {args.shape} spans "
          "(generated, or read from .cache/ where an earlier run left them) ...")
    bodies = make_bodies(args.distinct_batches, args.spans_per_batch, args.shape)
    mean_bytes = statistics.mean(len(b) for b, _ in bodies)
    print(f"  {sum(s for _, s in bodies)} spans, {mean_bytes / 1024:.0f} KiB per batch")

    ceiling, ceiling_cpu = raw_ceiling(bodies, args.seconds / 2)
    with tempfile.TemporaryDirectory() as tmp:
        collector = CollectorProcess(Path(tmp)).start()
        try:
            cpu_before, threads_before = cpu_seconds(collector.proc.pid), thread_times(collector.proc.pid)
            acked, elapsed, latencies, exports, refused, errors = drive(
                collector.port, bodies, args.senders, args.seconds, args.max_requests)
            cpu_after, threads_after = cpu_seconds(collector.proc.pid), thread_times(collector.proc.pid)
            health = collector.health()
            lag = wait_merged(collector)
        finally:
            collector.stop()
        stored, llm_requests = collector.sql("SELECT (SELECT count(*) FROM spans), (SELECT count(*) FROM requests)")[0]
    rate = acked / elapsed
    print(f"collector: {rate:,.0f} spans/s persisted and acknowledged ({acked:,} spans in {elapsed:.1f} s, "
          f"{len(latencies)} requests, {refused} refused with 503 and sent again, {errors} errors; "
          f"{stored:,} spans in the store)")
    print(f"tables:    {stored / (elapsed + lag):,.0f} spans/s into the tables (everything stored, over the run and "
          "the time until the last acknowledged span was in them)")
    print(f"latency:   p50 {percentile(latencies, 0.5):.1f} ms, p99 {percentile(latencies, 0.99):.1f} ms a request "
          f"at {args.senders} senders; an export, from its first attempt to its acknowledgement: "
          f"p50 {percentile(exports, 0.5):.1f} ms, p99 {percentile(exports, 0.99):.1f} ms")
    print(f"ceiling:   {ceiling:,.0f} spans/s (parse + journal + merge: one thread and the merge thread, no HTTP)")
    print(f"ratio:     {rate / ceiling:.0%} of the raw ceiling")
    if cpu_before is not None and cpu_after is not None and acked:
        # CPU per span is what a loaded machine changes least: compare it across runs and branches.
        print(f"cpu:       {(cpu_after - cpu_before) / acked * 1e6:.0f} us per span in the collector (all its "
              f"processes), {ceiling_cpu * 1e6:.0f} us in the ceiling")
    if threads_before is not None and threads_after is not None and acked:
        # Which thread sets the pace (the busiest), and which wait for a core rather than for work.
        print(f"threads:   per span, by thread: {thread_report(threads_before, threads_after, acked, elapsed)}")
    print(f"requests:  {len(latencies) / elapsed:,.1f} export requests/s acknowledged "
          f"({acked / max(1, len(latencies)):,.0f} spans each); {llm_requests / elapsed:,.0f} LLM requests/s "
          "(llm.request spans stored)")
    print(f"visible:   everything acknowledged was in the tables {lag * 1000:.0f} ms after the last acknowledgement")
    journal = health["journal"]
    files = journal.get("span_files")
    if files and files["files"]:  # the spans of large merges in Parquet files (collector/stores/span_files.py)
        print(f"files:     {files['spans']:,} spans in {files['files']} span files at the end of the run "
              f"(by level {files['files_by_level']}), {files['compactions']} compactions during it")
    if "spills" in journal:  # the checkpoint's pause spilled to disk instead of refusing (collector/stores/journal.py)
        print(f"spilled:   {journal['spills']} batches spilled to disk while merges were held up")
    receiver = health["receiver"]
    if receiver["requests"]:
        # Where a request waited (collector/receiver/ingest.py RECEIVER_STAGES): a stage much longer than its CPU
        # (µs per span above, spread over threads) is a wait for a core.
        stages = ", ".join(f"{stage} {spent / receiver['requests'] * 1000:.1f} ms"
                           for stage, spent in receiver["seconds"].items())
        print(f"stages:    a request, on average in the collector: {stages}")
        # The collector's own p99 (from receiving a request to acknowledging it; the senders' above
        # adds the connection), as /metrics' histogram bounds it.
        counts, bounds = receiver["counts"]["request"], [*receiver["le"], math.inf]
        at = next(i for i, seen in enumerate(itertools.accumulate(counts)) if seen >= 0.99 * receiver["requests"])
        low = bounds[at - 1] * 1000 if at else 0
        print(f"receiver:  p99 of a request in the collector between {low:g} and {bounds[at] * 1000:g} ms")
    print(f"rejected:  {health['rejected']}")
    return 0 if stored >= acked else 1


if __name__ == "__main__":
    raise SystemExit(main())
