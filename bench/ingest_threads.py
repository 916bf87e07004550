"""Where an ingesting collector's CPU goes, per thread: microseconds of CPU per span acknowledged.

Drives a real collector as bench/ingest.py does (4 senders over loopback, engine-shaped batches from
its cache), then reads each thread's user + system time from /proc/PID/task/TID/stat before and
after (after the journal is merged, so the merge thread's share is whole), and names the threads
with ``py-spy dump`` (``pip install py-spy``; without it they are listed by thread id). The senders'
own CPU (this process) is given beside them: on a 2-core machine they share the cores.

    python bench/ingest_threads.py [--seconds 10] [--distinct-batches 3000]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness_collector import CollectorProcess
from ingest import drive, make_bodies, wait_merged


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of ``pid``."""
    tick, found = os.sysconf("SC_CLK_TCK"), {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        found[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return found


def thread_names(pid: int) -> dict[int, str]:
    """Thread id -> Python thread name, from py-spy (empty without it)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return {}
    dump = subprocess.run([spy, "dump", "-p", str(pid)], capture_output=True, text=True, timeout=60).stdout
    names = {}
    for match in re.finditer(r'^Thread (\S+) \(\w+\): "([^"]+)"', dump, re.MULTILINE):
        names[int(match.group(1), 0)] = match.group(2)
    return names


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
            before, senders = thread_cpu(pid), time.process_time()
            acked, elapsed, _, _, refused, errors = drive(collector.port, bodies[8:], 4, args.seconds, 1_000_000)
            senders = time.process_time() - senders
            wait_merged(collector)
            after, names, journal = thread_cpu(pid), thread_names(pid), collector.health()["journal"]
        finally:
            collector.stop()
    print(f"{acked / elapsed:,.0f} spans/s acknowledged over {elapsed:.1f} s ({acked:,} spans, {refused} refused "
          f"with 503 and sent again, {errors} errors); "
          f"{journal['merges']} merges of {journal['merged_spans'] / max(1, journal['merges']):,.0f} spans on average")
    used = sorted(((after[tid] - before.get(tid, 0.0), tid) for tid in after), reverse=True)
    for seconds, tid in used:
        if seconds >= 0.01:
            print(f"  {seconds / acked * 1e6:6.2f} us/span  {names.get(tid, f'thread {tid}')}")
    print(f"  {sum(s for s, _ in used) / acked * 1e6:6.2f} us/span  the collector, all threads")
    print(f"  {senders / acked * 1e6:6.2f} us/span  the 4 senders (this process)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
