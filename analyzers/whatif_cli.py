"""What-if replay: would more cache, more instances or another routing policy have saved prefill?

Replays recorded traffic (a window of the store, through a running collector with ``--url`` or a
stopped one's file with ``--db``) or a trace file (Mooncake's JSON-lines format) through one LRU
block cache per instance, for every combination of capacities and routing policies, and prints the
token hit ratio, prefill tokens saved and the TTFT they would save. The model is defined in
docs/whatif.md.

    tokentrace whatif --since 1h --capacity-tokens 100000,400000,inf --route recorded,round_robin,prefix
    tokentrace whatif --trace conversation_trace.jsonl --format mooncake --block-size 512 \\
        --capacity-tokens 1000000,inf --instances 4 --route round_robin,session --json
"""

from __future__ import annotations

import argparse
import json
import urllib.parse

from tokentrace.analyzers.cli import add_slice_options, add_source_options, fetch_json, slice_from, window_and_slice
from tokentrace.analyzers.evidence import plural
from tokentrace.errors import ConfigError

FORMATS = ("mooncake",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The whatif options (docs/whatif.md)."""
    add_source_options(parser)
    parser.add_argument("--since", default=None, help="window of recorded traffic, ending now: 30m, 1h, 2d or 'all' "
                                                      "(default 1h, unless --from or --until is given)")
    add_slice_options(parser)
    parser.add_argument("--trace", default=None, help="replay a trace file instead of the store")
    parser.add_argument("--format", default="mooncake", choices=FORMATS, help="the trace file's format (mooncake)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per block: the trace's (512 for Mooncake's published traces; default 512), "
                             "or for recorded traffic a multiple of the recorded block size")
    capacity = parser.add_mutually_exclusive_group()
    capacity.add_argument("--capacity-tokens", default=None,
                          help="cache capacity per instance in tokens, a comma-separated list; 'inf' is unlimited "
                               "(default inf)")
    capacity.add_argument("--capacity-bytes", default=None,
                          help="cache capacity per instance in bytes, a list like --capacity-tokens; converted at "
                               "each instance's KV bytes per token")
    parser.add_argument("--instances", type=int, default=None,
                        help="instances to simulate (default: as many as served the window; 1 for a trace)")
    parser.add_argument("--route", default=None,
                        help="routing policies, comma-separated: recorded, round_robin, least_loaded, session, prefix "
                             "(default: recorded for the store, round_robin for a trace)")
    parser.add_argument("--cache-model", default="blocks", choices=("blocks", "entries"),
                        help="blocks: LRU over blocks (default; vLLM-like); entries: LRU over whole entries "
                             "(the MLX engine, mlx-lm)")
    parser.add_argument("--kv-bytes-per-token", type=int, default=None,
                        help="KV bytes per token for --capacity-bytes where no heartbeat says it (a trace file)")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=None,
                        help="prefill rate for the TTFT saved where the record has none (a trace file)")
    parser.add_argument("--tpot-ms", type=float, default=None,
                        help="a trace's requests end at arrival + output_length x this (least_loaded, prefix)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def parse_capacities(text: str | None, what: str) -> list[int | None]:
    """'3000000,inf' -> [3000000, None]; ConfigError naming ``what`` on anything else."""
    values: list[int | None] = []
    for item in (text or "inf").split(","):
        item = item.strip().lower().replace("_", "")
        if item in ("inf", "unlimited"):
            values.append(None)
            continue
        try:
            value = int(item)
        except ValueError:
            value = -1
        if value < 0:
            raise ConfigError(f"{what} must be a comma-separated list of whole numbers or 'inf', received {text!r}")
        values.append(value)
    return values


def recorded_workload(args: argparse.Namespace):
    """The window's traffic (``--since``) from the DuckDB file of ``--db``, or asked of ``--url``."""
    from tokentrace.analyzers.whatif import Workload
    from tokentrace.analyzers.workload import load_workload

    if args.db:
        from tokentrace.collector.stores.store_duckdb import DuckDBStore

        window, _ = window_and_slice(args, "1h")
        store = DuckDBStore(args.db, read_only=True)
        try:
            return load_workload(store, *window, where=slice_from(args))
        finally:
            store.close()
    _, given = window_and_slice(args, "1h")
    query = urllib.parse.urlencode(given)
    return Workload.from_dict(fetch_json(args, "/api/workload?" + query))


def _workload(args: argparse.Namespace):
    from tokentrace.analyzers.workload import MOONCAKE_BLOCK_SIZE, read_mooncake, rechunk

    if args.trace:
        if args.url or args.db:
            raise ConfigError("give either --trace FILE or a store (--url / --db), not both")
        chosen = [f"--{name.replace('_', '-')}" for name in ("since", "start", "until", "instance", "model",
                                                              "session", "request_prefix")
                  if getattr(args, name) is not None]
        if chosen:
            raise ConfigError(f"{', '.join(chosen).replace('--start', '--from')} choose recorded traffic in the store; "
                              "a --trace file is replayed whole")
        return read_mooncake(args.trace, args.block_size or MOONCAKE_BLOCK_SIZE, args.tpot_ms,
                             args.prefill_tokens_per_s, args.kv_bytes_per_token)
    workload = recorded_workload(args)
    workload.kv_bytes_per_token = args.kv_bytes_per_token
    workload.prefill_tokens_per_s = args.prefill_tokens_per_s or workload.prefill_tokens_per_s
    return rechunk(workload, args.block_size)


def run(args: argparse.Namespace) -> int:
    """Load the workload, replay every combination, print."""
    from tokentrace.analyzers.whatif import Capacity, grid

    if args.capacity_bytes is not None:
        capacities = [Capacity(bytes=v) if v is not None else Capacity() for v in
                      parse_capacities(args.capacity_bytes, "--capacity-bytes")]
    else:
        capacities = [Capacity(tokens=v) for v in parse_capacities(args.capacity_tokens, "--capacity-tokens")]
    workload = _workload(args)
    routes = [r.strip() for r in (args.route or ("round_robin" if args.trace else "recorded")).split(",") if r.strip()]
    result = grid(workload, capacities, args.instances, routes, args.cache_model)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def _cap(value: int | None) -> str:
    return "unlimited" if value is None else f"{value:,}"


def render(result: dict) -> str:
    """A table: one line per combination, and what the engines actually achieved."""
    lines = [f"{plural(result['requests'], 'request')} from the {result['source']} "
             f"(block {result['block_size']} tokens, "
             f"{result['cache_model']} cache model"
             + (f"; {result['skipped_requests']} without a prompt fingerprint left out" if result["skipped_requests"]
                else "") + ")"]
    if result["recorded"]:
        rec = result["recorded"]
        lines.append(f"recorded: token hit ratio {rec['token_hit_ratio']:.1%}, {rec['prefill_tokens_saved']:,} "
                     "prefill tokens saved")
    lines.append(f"{'route':<13}{'instances':>10}{'capacity tokens':>18}{'hit ratio':>11}{'tokens saved':>15}"
                 f"{'TTFT saved':>14}")
    for row in result["results"]:
        ttft = "unknown" if row["ttft_saved_ms"] is None else f"{row['ttft_saved_ms'] / 1000:,.1f} s"
        ratio = "n/a" if row["token_hit_ratio"] is None else f"{row['token_hit_ratio']:.1%}"
        lines.append(f"{row['route']:<13}{row['instances']:>10}{_cap(row['capacity_tokens']):>18}{ratio:>11}"
                     f"{row['prefill_tokens_saved']:>15,}{ttft:>14}")
    return "\n".join(lines)
