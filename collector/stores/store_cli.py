"""Check or repair a stopped collector's DuckDB store: ``tokentrace store check|repair --db FILE``.

check reads the store and changes nothing: every journal record, every span file and every table,
and the span files against what the store lists (docs/collector.md, "Checking and repairing a
store"). One line a finding (damage, or a note: what the next open does by itself), then a summary;
--json prints one object. Exit 0: no damage, 1: damage found, 2: no store there, or a collector
holds it.

    tokentrace store check --db tokentrace.duckdb

repair sets aside what is damaged in FILE.quarantine/ (the collector's own quarantine, with its
losses.jsonl lines), appends every intact acknowledged batch, and says what is lost; then checks
again. Exit 0 when the store is then clean, 1 when damage remains, 2 as check.

    tokentrace store repair --db tokentrace.duckdb
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Subcommands check and repair with their options."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    for name, help_text in (
            ("check", "verify the journal, the span files and the tables; change nothing"),
            ("repair", "quarantine what is damaged, append what can be appended, say what is lost")):
        one = sub.add_parser(name, help=help_text, description=help_text)
        one.add_argument("--db", default=os.environ.get("TOKENTRACE_DB", "./tokentrace.duckdb"),
                         help="the store's DuckDB file (default $TOKENTRACE_DB or ./tokentrace.duckdb); its "
                              "collector must be stopped")
        one.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    """Check or repair the store, print what was found (and done); 0 clean, 1 damaged."""
    import logging
    import sys

    from tokentrace.collector.stores import store_check

    # The collector's own lines (what its open quarantines, for repair) go to stderr, as it logs them.
    logging.basicConfig(level=logging.WARNING, format="tokentrace store: %(levelname)s %(message)s",
                        stream=sys.stderr)
    if args.action == "check":
        result = store_check.check(args.db)
        lines = [finding.line() for finding in result.findings] + [result.summary()]
    else:
        result = store_check.repair(args.db)
        lines = result.lines()
    print(store_check.dumps(result) if args.json else "\n".join(lines))
    return 0 if result.clean else 1
