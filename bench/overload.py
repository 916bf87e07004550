"""Overload benchmark (issue 11 item 3): many senders of large batches against a real collector.

64 senders each post 14 MB OTLP protobuf batches of engine-shaped spans (bench/synth.py, fresh ids
for every batch) for 60 s. A sender that gets 503 waits its Retry-After and sends the same batch
again, as an OTLP exporter does; a refused connection counts the same way. Prints, measured in one
run: the collector's idle and peak RSS (its own process, and with its parse workers) against
idle + 2 x --max-pending-bytes, the latency of accepted requests (p50, p99), how many were refused
and how, and whether every acknowledged span is stored exactly once.

    python bench/overload.py [--senders 64] [--mib 14] [--seconds 60] [--max-pending-mib 256]
"""

from __future__ import annotations

import argparse
import http.client
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness_collector import CollectorProcess
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from synth import Workload

#: The number of the warm-up batch (the first 4 bytes of its span ids), kept out of the counts.
WARM = 0xFFFF0000


def template(mib: float) -> ExportTraceServiceRequest:
    """One request of about ``mib`` MiB of engine-shaped spans."""
    batches, request = Workload(seed=5).batches(512), ExportTraceServiceRequest()
    while request.ByteSize() < mib * (1 << 20):
        request.resource_spans.extend(next(batches).resource_spans)
    return request


class Bodies:
    """Distinct bodies from one template: every span gets a trace id and span id of its own."""

    def __init__(self, request: ExportTraceServiceRequest, first: int = 1):
        self.request = request
        self.spans = [span for r in request.resource_spans for s in r.scope_spans for span in s.spans]
        self._lock = threading.Lock()
        self._next = first

    def make(self) -> tuple[bytes, int, int]:
        """(body, spans, number): the number is the first 4 bytes of each of its span ids."""
        with self._lock:
            number = self._next
            self._next += 1
            for index, span in enumerate(self.spans):
                span.trace_id = struct.pack(">QQ", number, index)
                span.span_id = struct.pack(">II", number, index)
            return self.request.SerializeToString(), len(self.spans), number


def rss(pid: int) -> tuple[int, int]:
    """(RSS of ``pid``, RSS of ``pid`` and its children) in bytes, from /proc."""
    def one(p: int) -> int:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    children.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    own = one(pid)
    return own, own + sum(one(child) for child in children)


def drive(port: int, bodies: Bodies, senders: int, seconds: float) -> dict:
    """Post from ``senders`` threads until the deadline; a batch is resent until acknowledged."""
    stats = {"acked_spans": 0, "accepted": [], "refused_503": 0, "refused_conn": 0, "other": 0, "acked": []}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def sender() -> None:
        body, spans, number = bodies.make()
        while time.monotonic() < deadline:
            began = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            try:
                conn.request("POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf"})
                response = conn.getresponse()
                response.read()
                status, retry = response.status, float(response.getheader("Retry-After") or 1)
            except (ConnectionError, http.client.HTTPException, OSError):
                status, retry = None, 1.0
            finally:
                conn.close()
            took = time.perf_counter() - began
            with lock:
                if status == 200:
                    stats["acked_spans"] += spans
                    stats["acked"].append(number)
                    stats["accepted"].append(took)
                elif status == 503:
                    stats["refused_503"] += 1
                elif status is None:
                    stats["refused_conn"] += 1
                else:
                    stats["other"] += 1
            if status == 200:
                body, spans, number = bodies.make()
            else:
                time.sleep(retry)

    threads = [threading.Thread(target=sender) for _ in range(senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--senders", type=int, default=64)
    parser.add_argument("--mib", type=float, default=14.0, help="size of each batch")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-pending-mib", type=int, default=256, help="the collector's --max-pending-bytes")
    args = parser.parse_args()

    request = template(args.mib)
    bodies = Bodies(request)
    print(f"batches of {request.ByteSize() / (1 << 20):.1f} MiB, {len(bodies.spans)} spans each, "
          f"{args.senders} senders, {args.seconds:.0f} s, --max-pending-bytes {args.max_pending_mib} MiB")
    budget = args.max_pending_mib << 20
    with tempfile.TemporaryDirectory() as tmp:
        collector = CollectorProcess(Path(tmp), "--max-pending-bytes", str(budget)).start()
        try:
            cold_own, _ = rss(collector.proc.pid)
            warm, _, _ = Bodies(template(0.01), WARM).make()  # one small batch: imports and pools warm
            assert collector.post(warm, "application/x-protobuf").status_code == 200
            idle_own, idle_all = rss(collector.proc.pid)
            peak = [idle_own, idle_all]
            done = threading.Event()

            def sample() -> None:
                while not done.wait(0.1):
                    own, everything = rss(collector.proc.pid)
                    peak[0], peak[1] = max(peak[0], own), max(peak[1], everything)

            sampler = threading.Thread(target=sample)
            sampler.start()
            stats = drive(collector.port, bodies, args.senders, args.seconds)
            done.set()
            sampler.join()
            health = collector.health()
        finally:
            collector.stop()
        [(stored, distinct)] = collector.sql("SELECT count(*), count(DISTINCT (trace_id, span_id)) FROM spans "
                                             f"WHERE span_id NOT LIKE '{WARM:08x}%'")
        [(acked_stored,)] = collector.sql("SELECT count(*) FROM spans WHERE substr(span_id, 1, 8) IN "
                                          "(SELECT unnest(?))", [[f"{n:08x}" for n in stats["acked"]]])
    accepted = sorted(stats["accepted"])
    p50 = accepted[len(accepted) // 2] if accepted else float("nan")
    p99 = accepted[min(len(accepted) - 1, int(len(accepted) * 0.99))] if accepted else float("nan")
    mib = 1 << 20
    bound = idle_own + 2 * budget
    print(f"RSS:      collector at start {cold_own / mib:.0f} MiB, idle after one small batch "
          f"{idle_own / mib:.0f} MiB, peak {peak[0] / mib:.0f} MiB "
          f"(bound idle + 2 x budget = {bound / mib:.0f} MiB: {'met' if peak[0] <= bound else 'NOT met'}); "
          f"with parse workers idle {idle_all / mib:.0f} MiB, peak {peak[1] / mib:.0f} MiB")
    print(f"accepted: {len(accepted)} requests, p50 {p50:.2f} s, p99 {p99:.2f} s "
          f"(target p99 <= 2 s: {'met' if p99 <= 2 else 'NOT met'})")
    print(f"refused:  {stats['refused_503']} x 503 + Retry-After, {stats['refused_conn']} connections closed "
          f"before the answer was read, {stats['other']} other; budget peak "
          f"{health['pending']['peak_bytes'] / mib:.0f} MiB")
    once = stored == distinct and acked_stored == stats["acked_spans"]
    print(f"stored:   {stored:,} spans ({distinct:,} distinct); {stats['acked_spans']:,} acknowledged, "
          f"{acked_stored:,} of them stored: {'every acknowledged span stored once' if once else 'MISMATCH'}"
          f"{'' if stored == acked_stored else f' ({stored - acked_stored:,} stored whose answer was not read)'}")
    return 0 if once else 1


if __name__ == "__main__":
    raise SystemExit(main())
