"""Advice benchmark: what `analyze advise` and the pages that show advice cost, side by side.

Feeds a real collector synthetic engine-shaped requests (bench/synth.py over OTLP protobuf, 4
instances, all in the last 5 minutes), then times, in one run and against the same store:
  - `tokentrace analyze report --since 1h --url` (the window's verdicts and counts: the floor a
    window-wide answer costs; 25 cache verdicts) and `tokentrace analyze advise --since 1h --url`
    (400 cache verdicts, its default, plus every what-if replay advice needs), and advise with
    `--verdicts 100`, and their ratios;
  - the Advice page's JSON twin `GET /advice.json` cold (a window not asked before; its verdicts
    are remembered across windows, so only the first computes all of them) and warm (the pages'
    30-second memo; `/api/advice` and the command compute afresh every time), and the
    overview `/` first load (its Advice panel, over 30 verdicts, computed) and warm;
  - the advice's own size: verdicts read, kinds given.

    python bench/advise.py [--requests 10000] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import httpx
from dashboard import REQUESTS_PER_BATCH, feed
from harness_collector import CollectorProcess


def cli_ms(args: list[str]) -> tuple[float, str]:
    """Wall ms of one `tokentrace` command, and its stdout."""
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "tokentrace", *args], capture_output=True, text=True, timeout=600)
    elapsed = (time.perf_counter() - started) * 1000
    if out.returncode != 0:
        raise SystemExit(f"tokentrace {' '.join(args)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return elapsed, out.stdout


def get_ms(client: httpx.Client, url: str) -> float:
    started = time.perf_counter()
    client.get(url, timeout=600).raise_for_status()
    return (time.perf_counter() - started) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.requests % REQUESTS_PER_BATCH:
        parser.error(f"--requests must be a multiple of {REQUESTS_PER_BATCH}")
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        collector = CollectorProcess(Path(tmp)).start()
        try:
            print(f"fed {args.requests} requests in {feed(collector, args.requests):.1f} s")
            cli_ms(["analyze", "report", "--since", "1h", "--url", collector.url])  # warm the store's caches
            advice = None
            for _ in range(args.runs):
                report, _ = cli_ms(["analyze", "report", "--since", "1h", "--url", collector.url, "--json"])
                advise, text = cli_ms(["analyze", "advise", "--since", "1h", "--url", collector.url, "--json"])
                fewer, _ = cli_ms(["analyze", "advise", "--since", "1h", "--url", collector.url, "--json",
                                   "--verdicts", "100"])
                rows.setdefault("report", []).append(report)
                rows.setdefault("advise", []).append(advise)
                rows.setdefault("advise 100", []).append(fewer)
                advice = json.loads(text)
            with httpx.Client() as client:
                for n in range(args.runs):
                    # A window not asked before is computed; the same one again comes from the memo.
                    for name, path in (("page", f"/advice.json?since={60 + n}m"), ("overview", f"/?since={30 + n}m")):
                        rows.setdefault(f"{name} cold", []).append(get_ms(client, collector.url + path))
                        rows.setdefault(f"{name} warm", []).append(get_ms(client, collector.url + path))
        finally:
            collector.stop()
    kinds = [item["kind"] for item in advice["advice"]] if advice else []
    print(f"advice over {advice['verdicts'] if advice else '?'} verdicts: {', '.join(kinds) or 'none'}")
    median = {name: statistics.median(values) for name, values in rows.items()}
    for name, values in rows.items():
        print(f"{name:<14} median {median[name]:8.0f} ms  max {max(values):8.0f} ms  ({len(values)} runs)")
    print(f"advise / report: {median['advise'] / median['report']:.1f}x; "
          f"advise / advise --verdicts 100: {median['advise'] / median['advise 100']:.1f}x; "
          f"advice page cold / warm: {median['page cold'] / median['page warm']:.0f}x; "
          f"overview cold / warm: {median['overview cold'] / median['overview warm']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
