"""What-if replay speed: 12,000 requests × 10 capacities (issue 16: "in seconds").

The workload is the Mooncake FAST'25 sample in tests/fixtures/mooncake (2,000 requests) taken six
times with disjoint block ids: 12,000 requests of the published trace's shape (512-token blocks,
~14 blocks a request). Prints the time of each model and route side by side.

    python bench/whatif.py
"""

from __future__ import annotations

import time
from pathlib import Path

from tokentrace.analyzers.whatif import Capacity, TraceRequest, Workload, grid
from tokentrace.analyzers.workload import MOONCAKE_BLOCK_SIZE, read_mooncake

SAMPLE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "mooncake" / "conversation_trace.head2000.jsonl"
CAPACITIES = [Capacity(tokens=c) for c in (25_000, 50_000, 100_000, 200_000, 400_000, 800_000, 1_600_000,
                                           3_200_000, 6_400_000)] + [Capacity()]


def workload(copies: int = 6) -> Workload:
    base = read_mooncake(SAMPLE, MOONCAKE_BLOCK_SIZE)
    shift = 1 + max(b for r in base.requests for b in r.blocks)
    requests = [TraceRequest(r.t_ms + copy * 3_600_000, r.input_length, r.output_length,
                             tuple(b + copy * shift for b in r.blocks), end_ms=r.t_ms + copy * 3_600_000 + 20.0 *
                             r.output_length) for copy in range(copies) for r in base.requests]
    return Workload(requests, MOONCAKE_BLOCK_SIZE, "mooncake")


def main() -> None:
    load = workload()
    blocks = sum(len(r.blocks) for r in load.requests)
    print(f"{len(load.requests)} requests, {blocks} block references, {len(CAPACITIES)} capacities")
    for model, instances, route in (("blocks", 1, "round_robin"), ("entries", 1, "round_robin"),
                                    ("blocks", 4, "session"), ("blocks", 4, "prefix")):
        started = time.perf_counter()
        out = grid(load, CAPACITIES, instances, [route], model)
        elapsed = time.perf_counter() - started
        print(f"{model:<8} {route:<12} x{instances}: {elapsed:6.2f} s  "
              f"(unlimited ratio {out['results'][-1]['token_hit_ratio']:.3f})")


if __name__ == "__main__":
    main()
