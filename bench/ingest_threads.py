"""Where an ingesting collector's CPU goes, per thread: microseconds of CPU per span acknowledged.

Drives a real collector as bench/ingest.py does (4 senders over loopback, engine-shaped batches from
its cache), then reads each thread's user + system time and how long it was runnable but waiting
for a core from /proc/PID/task/TID/ before and after (after the journal is merged, so the merge
thread's share is whole), by the names the collector gives its threads (core/threads.py:
``tt-merge``, ``tt-writer``, ``tt-decode_N``...; a pool's threads together). The senders' own CPU
(this process) is given beside them: on a 2-core machine they share the cores. bench/ingest.py
prints the same per thread in one line, over its run.

    python bench/ingest_threads.py [--seconds 10] [--distinct-batches 3000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness_collector import CollectorProcess
from ingest import drive, make_bodies, thread_deltas, thread_times, wait_merged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--distinct-batches", type=int, default=3000)
    args = parser.parse_args()
    bodies = make_bodies(args.distinct_batches, 512)
    with tempfile.TemporaryDirectory() as tmp:
        collector = CollectorProcess(Path(tmp)).start()
        try:
            pid = collector.proc.pid
            drive(collector.port, bodies[:8], 4, 5, 8)  # warm: imports, first merges
            before, senders, began = thread_times(pid), time.process_time(), time.monotonic()
            acked, elapsed, _, _, refused, errors = drive(collector.port, bodies[8:], 4, args.seconds, 1_000_000)
            senders = time.process_time() - senders
            wait_merged(collector)
            after, journal, wall = thread_times(pid), collector.health()["journal"], time.monotonic() - began
        finally:
            collector.stop()
    print(f"{acked / elapsed:,.0f} spans/s acknowledged over {elapsed:.1f} s ({acked:,} spans, {refused} refused "
          f"with 503 and sent again, {errors} errors); "
          f"{journal['merges']} merges of {journal['merged_spans'] / max(1, journal['merges']):,.0f} spans on average")
    used = thread_deltas(before, after, wall)
    for seconds, waited, name in used:
        if seconds >= 0.01:
            print(f"  {seconds / acked * 1e6:6.2f} us/span  {name}, waiting for a core {waited:.0%} of the time")
    print(f"  {sum(s for s, _, _ in used) / acked * 1e6:6.2f} us/span  the collector, all threads")
    print(f"  {senders / acked * 1e6:6.2f} us/span  the 4 senders (this process)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
