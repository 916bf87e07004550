"""Export traces for other tools: ``tokentrace export perfetto`` and ``tokentrace export mooncake``.

Writes Chrome trace-event JSON that ui.perfetto.dev (and chrome://tracing) opens: one track per
request with its phases, one per instance for engine steps, model-load stages, and evictions as
instant events. Reads a running collector (``--url``, default http://127.0.0.1:4318) or a stopped
collector's DuckDB file (``--db``); both give the same JSON.

    tokentrace export perfetto --since 10m -o trace.json
    tokentrace export perfetto --request-id REQ -o request.json --db tokentrace.duckdb

``mooncake`` writes the window's requests in Mooncake's JSON-lines trace format (``timestamp`` ms,
``input_length``, ``output_length``, ``hash_ids``: chained block ids, renumbered), which Mooncake's
and other KV-cache simulators read, and ``tokentrace whatif --trace`` too:

    tokentrace export mooncake --since 1h --block-size 512 -o traffic.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
from pathlib import Path

from tokentrace.analyzers.cli import add_slice_options, add_source_options, fetch_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Subcommand perfetto with its options."""
    sub = parser.add_subparsers(dest="format", metavar="FORMAT")
    sub.required = True
    perfetto = sub.add_parser("perfetto", help="Chrome trace-event JSON for ui.perfetto.dev",
                              description="Chrome trace-event JSON for ui.perfetto.dev or chrome://tracing.")
    which = perfetto.add_mutually_exclusive_group()
    which.add_argument("--request-id", default=None, help="one request (with its instance's steps meanwhile)")
    which.add_argument("--since", default="15m", help="requests that started in this window: 30s, 10m, 1h, 'all' "
                                                      "(default 15m)")
    perfetto.add_argument("-o", "--output", required=True, help="file to write, '-' for standard output")
    add_source_options(perfetto)
    mooncake = sub.add_parser("mooncake", help="Mooncake's JSON-lines trace format (for KV-cache simulators)",
                              description="The window's requests in Mooncake's JSON-lines trace format.")
    mooncake.add_argument("--since", default=None, help="requests that started in this window, ending now: 30m, "
                                                         "1h, 'all' (default 1h, unless --from or --until is given)")
    add_slice_options(mooncake)
    mooncake.add_argument("--block-size", type=int, default=None,
                          help="tokens per block, a multiple of the recorded block size (default: the recorded one)")
    mooncake.add_argument("-o", "--output", required=True, help="file to write, '-' for standard output")
    add_source_options(mooncake)


def run(args: argparse.Namespace) -> int:
    """Build (``--db``) or fetch (``--url``) the trace and write it."""
    if args.format == "mooncake":
        return _mooncake(args)
    if args.db:
        from tokentrace.collector.stores.store_duckdb import DuckDBStore
        from tokentrace.dashboards.perfetto import perfetto_trace
        from tokentrace.window import since_ns

        store = DuckDBStore(args.db, read_only=True)
        try:
            window = None if args.request_id else since_ns(args.since)
            trace = perfetto_trace(store, request_id=args.request_id, since_ns=window)
        finally:
            store.close()
    else:
        query = {"request_id": args.request_id} if args.request_id else {"since": args.since}
        trace = fetch_json(args, "/api/export/perfetto?" + urllib.parse.urlencode(query))
    text = json.dumps(trace, separators=(",", ":"))
    if args.output == "-":
        sys.stdout.write(text + "\n")
    else:
        Path(args.output).write_text(text, encoding="utf-8")
        events = len(trace["traceEvents"])
        print(f"wrote {events} events ({trace['otherData']['requests']} requests) to {args.output}; "
              "open it at https://ui.perfetto.dev", file=sys.stderr)
    return 0


def _mooncake(args: argparse.Namespace) -> int:
    from tokentrace.analyzers.whatif_cli import recorded_workload
    from tokentrace.analyzers.workload import mooncake_lines, rechunk, write_lines

    workload = recorded_workload(args)
    workload = rechunk(workload, args.block_size)
    if args.output == "-":
        write_lines(mooncake_lines(workload), sys.stdout)
        return 0
    with open(args.output, "w", encoding="utf-8") as out:
        count = write_lines(mooncake_lines(workload), out)
    print(f"wrote {count} requests (block size {workload.block_size} tokens; {workload.skipped} without a prompt "
          f"fingerprint left out) to {args.output}", file=sys.stderr)
    return 0
