"""What exactly-once costs on ClickHouse (chdb), side by side in one run (docs/scale-out.md).

1. Write side, as the collector does it (collector/stores/once.py): the same batches written through a
   ``ClickHouseStore`` with the span check, and with the check switched off (every span taken as
   new) - spans/s of each.
2. Read side, the alternative not taken: ``spans`` copied into a ReplacingMergeTree ordered by
   (trace_id, span_id), every row inserted twice (a resend), and a window aggregate read with
   ``FINAL`` against the plain MergeTree without duplicates.

    python bench/exactly_once.py [--batches 30] [--spans-per-batch 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from synth import Workload

from tokentrace.collector import stores
from tokentrace.collector.decoding.normalize import normalize
from tokentrace.collector.stores import once

AGGREGATE = ("SELECT name, count(), quantile(0.99)(end_ns - start_ns) FROM {table} {final} "
             "GROUP BY name ORDER BY name")


def _batches(count: int, spans: int) -> list:
    source = Workload(seed=17).batches(spans)
    return [normalize(ExportTraceServiceRequest.FromString(next(source).SerializeToString())) for _ in range(count)]


def _write(store, batches: list, check: bool) -> float:
    """Spans/s writing ``batches`` (fresh copies: a write may replace a batch's rows)."""
    if not check:
        store._keys.fresh = lambda batch, _stored: np.ones(len(batch.rows["spans"]), dtype=bool)
    began, spans = time.perf_counter(), 0
    for batch in batches:
        store.write(batch)
        spans += batch.spans
    return spans / (time.perf_counter() - began)


def _median_ms(client, sql: str, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        client.query(sql)
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--spans-per-batch", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checked = stores.open_store(stores.parse(f"chdb://{tmp}/chdb?database=checked"))
        unchecked = stores.open_store(stores.parse(f"chdb://{tmp}/chdb?database=unchecked"))
        try:
            rates = {"unchecked": [], "checked": []}
            _write(unchecked, _batches(1, args.spans_per_batch), False)  # warm both before timing
            _write(checked, _batches(1, args.spans_per_batch), True)
            for _ in range(2):  # alternate, so that the machine's load hits both alike
                rates["unchecked"].append(_write(unchecked, _batches(args.batches // 2, args.spans_per_batch), False))
                rates["checked"].append(_write(checked, _batches(args.batches // 2, args.spans_per_batch), True))
            with_check, without = statistics.mean(rates["checked"]), statistics.mean(rates["unchecked"])
            print(f"write: {with_check:,.0f} spans/s with the span check, {without:,.0f} without "
                  f"({with_check / without:.0%})")
            client = checked._reader()
            client.command("CREATE TABLE spans_rmt AS spans ENGINE = ReplacingMergeTree "
                           "ORDER BY (trace_id, span_id) SETTINGS allow_nullable_key = 1")
            for _ in range(2):
                client.command("INSERT INTO spans_rmt SELECT * FROM spans")
            plain = _median_ms(client, AGGREGATE.format(table="spans", final=""))
            final = _median_ms(client, AGGREGATE.format(table="spans_rmt", final="FINAL"))
            rows = client.query("SELECT count() FROM spans").result_rows[0][0]
            print(f"read:  window aggregate over {rows:,} spans: {plain:.1f} ms on MergeTree, {final:.1f} ms on "
                  f"ReplacingMergeTree FINAL with every row resent once ({final / plain:.1f}x)")
            print(f"memory of the span check: {once.DEFAULT_CAPACITY:,} keys x 8 bytes at most")
        finally:
            checked.close()
            unchecked.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
