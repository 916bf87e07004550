"""Soak benchmark (issue 45 item 3): months of traffic compressed into minutes.

A real collector with a DuckDB store and ``--retention`` of minutes takes engine-shaped traffic
(bench/synth.py's batches of 512 spans, each moved to the moment it is sent and its request ids made
unique) at a steady rate for many retentions. Every ``--sample`` seconds it prints the store's size
on disk (its file, WAL, journal, span files: what ``du`` would say), what it uses (``/healthz``
``journal.disk``: DuckDB's used blocks and the rest), the collector's RSS, spans/s acknowledged and
the p99 of the acknowledgements in that window, and how long the verdicts of a request sent a few
seconds before take (``/api/requests/ID/slow`` and ``/cache``). At the end, side by side from the
same run: the steady samples' (one retention and two passes in) second half against their first,
medians, as ratios.
A store whose size grows with the traffic it has seen, or whose ingest or verdicts slow down as it
ages, shows it here. The workload is stationary: every session of bench/synth.py starts with a full
history (``--shape engine-full``), so prompts and the block lists stored for them are as long from
the first minute as at the last. With ``--shape engine`` sessions lengthen their prompts (each turn
joins the history, up to 2,048 tokens) for the first twenty minutes or so, and the stored block
lists with them: used blocks that grow over such a run are live data (docs/benchmarks.md, Soak).

    python bench/soak.py [--minutes 10] [--retention 2m] [--rate 1500] [--sample 30] [--shape engine-full]
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import httpx
from harness_collector import CollectorProcess
from ingest import make_bodies, percentile
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace import contract as c
from tokentrace.collector.settings import _retention
from tokentrace.collector.stores.retention import files_usage

SPANS_PER_BATCH = 512


def moved(body: bytes, now_ns: int, tag: str) -> tuple[bytes, str | None]:
    """``body`` with its spans moved to start at ``now_ns`` (their offsets kept) and ``tag`` put in
    front of every request id (the generated chunks reuse ids); the id of one llm.request in it."""
    request = ExportTraceServiceRequest.FromString(body)
    spans = [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]
    delta = now_ns - min(span.start_time_unix_nano for span in spans)
    rid = None
    for span in spans:
        span.start_time_unix_nano += delta
        span.end_time_unix_nano += delta
        for attribute in span.attributes:
            if attribute.key == c.REQUEST_ID:
                attribute.value.string_value = tag + attribute.value.string_value
                if span.name == c.SPAN_REQUEST:
                    rid = attribute.value.string_value
    return request.SerializeToString(), rid


def on_disk(db: Path) -> int:
    """Bytes the store takes on disk: its file, and its WAL and the folders beside it
    (``retention.files_usage``, what the disk budget counts besides the file's used blocks)."""
    return (db.stat().st_size if db.exists() else 0) + sum(files_usage(str(db)).values())


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Sender(threading.Thread):
    """Posts the bodies at ``rate`` spans/s, each moved to now; a batch refused with 503 is sent
    again after its Retry-After, as an OTLP exporter does."""

    def __init__(self, port: int, bodies: list[tuple[bytes, int]], rate: float, seconds: float):
        super().__init__(daemon=True)
        self.port, self.bodies, self.rate, self.seconds = port, bodies, rate, seconds
        self.lock = threading.Lock()
        self.acks: list[tuple[float, int, float]] = []  #: (when, spans, latency s)
        self.refused = self.errors = 0
        self.recent: list[tuple[float, str]] = []  #: (when sent, a request id in it)
        self.ran_out = False

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        start = time.monotonic()
        sent_spans = 0
        for i, (body, spans) in enumerate(self.bodies):
            due = start + sent_spans / self.rate
            if due - start > self.seconds:
                return
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)  # pacing the sender: the rate is the benchmark's input
            payload, rid = moved(body, time.time_ns(), f"soak{i}-")
            while True:
                began = time.monotonic()
                conn.request("POST", "/v1/traces", payload, {"Content-Type": "application/x-protobuf"})
                response = conn.getresponse()
                response.read()
                took = time.monotonic() - began
                with self.lock:
                    if response.status == 200:
                        self.acks.append((time.monotonic(), spans, took))
                        if rid:
                            self.recent.append((time.monotonic(), rid))
                        break
                    if response.status != 503:
                        self.errors += 1
                        break
                    self.refused += 1
                time.sleep(min(1.0, float(response.getheader("Retry-After") or 1)))
            sent_spans += spans
        self.ran_out = True

    def window(self, since: float) -> tuple[float, float]:
        """(spans/s acknowledged, p99 ms) since ``since`` (monotonic)."""
        now = time.monotonic()
        with self.lock:
            recent = [(spans, took) for when, spans, took in self.acks if when >= since]
        return sum(s for s, _ in recent) / max(1e-9, now - since), percentile([t for _, t in recent], 0.99)

    def settled_id(self, age: float = 5.0) -> str | None:
        """A request id sent at least ``age`` seconds ago (merged by now), the newest such."""
        cutoff = time.monotonic() - age
        with self.lock:
            older = [rid for when, rid in self.recent if when <= cutoff]
        return older[-1] if older else None


def verdict_ms(url: str, rid: str | None) -> tuple[float, float]:
    if rid is None:
        return float("nan"), float("nan")
    out = []
    for kind in ("slow", "cache"):
        began = time.perf_counter()
        response = httpx.get(f"{url}/api/requests/{rid}/{kind}", timeout=120)
        took = (time.perf_counter() - began) * 1000
        out.append(took if response.status_code == 200 else float("nan"))
    return out[0], out[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--retention", default="2m", help="the collector's --retention (minutes: 2m)")
    parser.add_argument("--rate", type=float, default=1500.0, help="spans/s sent")
    parser.add_argument("--sample", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--shape", choices=("engine-full", "engine"), default="engine-full",
                        help="engine-full: sessions start with full histories (a stationary workload); "
                             "engine: prompts lengthen over the run")
    args = parser.parse_args()
    seconds = args.minutes * 60
    retention_s = _retention(args.retention)
    # A "512" batch holds about 460 spans (synth.Workload counts 9 spans a request and adds 8).
    count = int(seconds * args.rate / (SPANS_PER_BATCH * 0.85)) + 2
    print(f"generating {count} batches of {SPANS_PER_BATCH} {args.shape} spans (cached in .cache/)", flush=True)
    bodies = make_bodies(count, SPANS_PER_BATCH, args.shape)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        collector = CollectorProcess(Path(tmp), "--retention", args.retention).start()
        try:
            sender = Sender(collector.port, bodies, args.rate, seconds)
            began = time.monotonic()
            sender.start()
            rows = []
            print(f"retention {args.retention}, {args.rate:,.0f} spans/s for {args.minutes:g} min, a sample every "
                  f"{args.sample:g} s\n")
            header = ("t s", "on disk MiB", "used MiB", "file MiB", "WAL MiB", "journal MiB", "spill MiB", "span files",
                      "RSS MiB", "spans/s", "p99 ms", "slow ms", "cache ms", "last pass s", "blocks MiB")
            print(" | ".join(header))
            last = began
            while sender.is_alive():
                sender.join(args.sample)
                now = time.monotonic()
                health = collector.health()["journal"]
                disk, files, kept = health["disk"], health["span_files"], health["retention"]["last_pass"]
                spans_s, p99 = sender.window(last)
                slow_ms, cache_ms = verdict_ms(collector.url, sender.settled_id())
                file_bytes = collector.db.stat().st_size
                row = (now - began, on_disk(collector.db) / 2**20, disk["total"] / 2**20, file_bytes / 2**20,
                       disk["wal"] / 2**20, disk["journal"] / 2**20, disk["spill"] / 2**20, files["files"],
                       rss_mib(collector.proc.pid), spans_s, p99, slow_ms, cache_ms, kept.get("seconds", float("nan")),
                       disk["file_blocks"] / 2**20)
                rows.append(row)
                print(" | ".join(f"{value:,.0f}" if i in (0, 7, 9) else f"{value:,.1f}" for i, value in enumerate(row)),
                      flush=True)
                last = now
            steady = [row for row in rows if row[0] >= retention_s + 2 * max(1.0, retention_s / 10)]
            print(f"\nacknowledged {sum(s for _, s, _ in sender.acks):,} spans, {sender.refused} refusals, "
                  f"{sender.errors} errors{'; ran out of batches' if sender.ran_out else ''}")
            if len(steady) >= 4:
                # Medians of the steady samples' first and second halves: the journal (a file up to 64 MiB
                # before the next) and the WAL (emptied at each pass) make single samples swing.
                half = len(steady) // 2
                early, late = steady[:half], steady[half:]
                names = ("on disk", "used", "DuckDB's used blocks", "DuckDB file", "RSS", "spans/s", "p99",
                         "slow verdict", "cache verdict")
                columns = (1, 2, 14, 3, 8, 9, 10, 11, 12)
                print(f"steady from {steady[0][0]:,.0f} s to {steady[-1][0]:,.0f} s, median of the second half / "
                      "the first:")
                for name, col in zip(names, columns, strict=True):
                    a, b = statistics.median(r[col] for r in early), statistics.median(r[col] for r in late)
                    print(f"  {name:>20}: {b:,.1f} / {a:,.1f} = {b / a:.2f}x")
                peak = max(row[1] for row in steady)
                print(f"  on-disk peak over the steady samples: {peak:,.1f} MiB")
            else:
                print("too short for a steady state: run longer than the retention plus two passes")
        finally:
            collector.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
