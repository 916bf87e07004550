"""Run a collector and two engine instances on a generated model, drive a scripted workload that
produces every slowness category and cache-miss cause, and print the verdicts."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tokentrace demo``."""
    parser.add_argument("--exit", action="store_true", help="stop after printing the verdicts")


def run(args: argparse.Namespace) -> int:
    """Not yet available: the demo lands with the analyzers."""
    print("tokentrace demo: not yet available (it lands with the analyzers)", file=sys.stderr)
    return 0
