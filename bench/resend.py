"""Resends beside fresh traffic: what one sender that sends stored batches again costs the others.

A real collector over loopback (bench/ingest.py's senders and cached engine batches, in time
order). Phase 1 stores a set of batches. Then, for ``--seconds`` each and alternating
``--rounds`` times: 4 senders send new batches alone; and the same 4 senders beside a fifth that
sends phase 1's batches again, as an exporter does after a lost acknowledgement or in a retry loop
(exactly once: collector/stores/once.py). Prints, per phase, new spans/s acknowledged and their p99, the
resent spans/s, and the collector's duplicate count, which must equal the resent spans.

    python bench/resend.py [--seconds 8] [--rounds 2] [--stored 600]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness_collector import CollectorProcess
from ingest import drive, make_bodies, percentile


def phase(port: int, fresh: list, stored: list, seconds: float, resending: bool) -> tuple:
    """4 senders on ``fresh`` for ``seconds``, beside a fifth resending ``stored`` when ``resending``:
    (new spans/s, their p99 in ms, refusals, errors, resent spans)."""
    resent: list = []
    thread = threading.Thread(target=lambda: resent.append(drive(port, stored, 1, seconds, 1_000_000)))
    if resending:
        thread.start()
    new, elapsed, latencies, _, refused, errors = drive(port, fresh, 4, seconds, 1_000_000)
    if resending:
        thread.join()
    return new / elapsed, percentile(latencies, 0.99), refused, errors, resent[0][0] if resent else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each measured phase")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--stored", type=int, default=600, help="batches stored first, then resent")
    args = parser.parse_args()
    bodies = make_bodies(6000, 512)
    stored, fresh = bodies[:args.stored], bodies[args.stored:]
    share = len(fresh) // (2 * args.rounds)  # new batches for each phase, none sent twice
    with tempfile.TemporaryDirectory() as tmp:
        collector = CollectorProcess(Path(tmp)).start()
        try:
            acked = drive(collector.port, stored, 4, 600, len(stored))[0]
            print(f"stored first: {acked:,} spans in {len(stored)} batches; {share} new batches a phase")
            for at, (round_, resending) in enumerate((r, s) for r in range(args.rounds) for s in (False, True)):
                before = collector.health()["duplicate_spans"]
                rate, p99, refused, errors, again = phase(collector.port, fresh[at * share:(at + 1) * share], stored,
                                                          args.seconds, resending)
                duplicates = collector.health()["duplicate_spans"] - before
                label = "new + resent" if resending else "new alone   "
                print(f"round {round_ + 1}, {label}: {rate:9,.0f} new spans/s, p99 {p99:6.1f} ms, {refused} refused, "
                      f"{errors} errors; resent {again / args.seconds:9,.0f} spans/s; duplicates counted "
                      f"{duplicates:,} (resent {again:,})")
        finally:
            collector.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
