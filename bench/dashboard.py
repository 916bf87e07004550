"""Dashboard benchmark: /timeline with 10,000 requests in view.

Feeds a real collector 10,000 synthetic engine-shaped requests (bench/synth.py, over OTLP
protobuf), then measures
  - the JSON twin: wall time of GET /timeline.json (target <= 200 ms), and its size;
  - the page: time from navigation start until the canvas has drawn every request, in Debian's
    headless Chromium (target <= 1 s), read from the page's own performance clock;
  - one full repaint of the canvas (what every zoom or pan frame costs).

    python bench/dashboard.py [--requests 10000] [--runs 5]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import httpx
from harness_browser import launch_chromium
from harness_collector import CollectorProcess
from synth import Workload

#: bench/synth.py emits 9 spans per request (+1 engine.steps window per 16): batches of at least 225
#: spans therefore hold exactly 25 requests.
REQUESTS_PER_BATCH, SPANS_PER_BATCH = 25, 225


def feed(collector: CollectorProcess, requests: int) -> float:
    """POST ``requests`` synthetic requests that all started in the last 5 minutes; returns seconds."""
    workload = Workload(seed=5, instances=4, start_ns=time.time_ns() - 300_000_000_000)
    started = time.perf_counter()
    for batch in itertools.islice(workload.batches(SPANS_PER_BATCH), requests // REQUESTS_PER_BATCH):
        response = collector.post(batch.SerializeToString(), "application/x-protobuf")
        response.raise_for_status()
    assert workload.count == requests, f"sent {workload.count} requests, meant {requests}"
    return time.perf_counter() - started


def time_twin(url: str, runs: int) -> tuple[list[float], int]:
    """Wall ms of GET /timeline.json, and its size in bytes."""
    times, size = [], 0
    with httpx.Client(timeout=60) as client:
        client.get(url).raise_for_status()  # warm: first query compiles, caches warm up
        for _ in range(runs):
            started = time.perf_counter()
            response = client.get(url)
            times.append((time.perf_counter() - started) * 1000)
            response.raise_for_status()
            size = len(response.content)
    return times, size


def time_page(url: str, requests: int, runs: int) -> tuple[list[float], list[float]]:
    """ms from navigation start to the first complete draw, and ms of one full repaint."""
    draws, repaints = [], []
    with launch_chromium() as browser:
        page = browser.new_page(viewport={"width": 1366, "height": 860})
        for _ in range(runs + 1):
            page.goto(url)
            page.wait_for_function(f"document.getElementById('timeline').dataset.requests === '{requests}'"
                                   " && window.tokentraceTimeline.firstDrawMs !== null", timeout=60_000)
            draws.append(page.evaluate("window.tokentraceTimeline.firstDrawMs"))
            repaints.append(page.evaluate("""() => {
                const tl = window.tokentraceTimeline.timeline, t0 = performance.now();
                for (let i = 0; i < 10; i++) tl.paint();
                return (performance.now() - t0) / 10; }"""))
    return draws[1:], repaints[1:]  # the first load also warms Chromium's caches


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if args.requests % REQUESTS_PER_BATCH:
        parser.error(f"--requests must be a multiple of {REQUESTS_PER_BATCH}")
    with tempfile.TemporaryDirectory() as tmp:
        collector = CollectorProcess(Path(tmp)).start()
        try:
            seconds = feed(collector, args.requests)
            print(f"fed {args.requests} requests in {seconds:.1f} s")
            twin, size = time_twin(collector.url + "/timeline.json?since=15m", args.runs * 4)
            draws, repaints = time_page(collector.url + "/timeline?since=15m", args.requests, args.runs)
        finally:
            collector.stop()
    print(f"/timeline.json: median {statistics.median(twin):.0f} ms, max {max(twin):.0f} ms "
          f"over {len(twin)} GETs; {size / 1024:.0f} KiB (target <= 200 ms)")
    print(f"/timeline fully drawn: median {statistics.median(draws):.0f} ms, max {max(draws):.0f} ms "
          f"over {len(draws)} loads (target <= 1000 ms)")
    print(f"full repaint (zoom/pan frame): median {statistics.median(repaints):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
