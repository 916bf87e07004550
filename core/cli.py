"""The one CLI group, ``tokentrace``. Only ``main()`` exits.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
modules import their heavy dependencies inside ``run`` so that ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tokentrace import __version__
from tokentrace.errors import ConfigError, NotFound, TokentraceError

#: (command, module, one-line help). The order is the order of ``tokentrace --help``.
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("collector", "tokentrace.collector.cli", "run the OTLP collector, its DuckDB store and dashboard"),
    ("analyze", "tokentrace.analyzers.cli", "verdicts: why a request was slow, why its cache lookup missed"),
    ("export", "tokentrace.dashboards.export_cli", "traces for other tools: Chrome trace-event JSON for Perfetto"),
    ("demo", "tokentrace.demo", "run the whole story on this machine on a tiny generated model"),
    ("engine", "tokentrace.engine_shim.mlx.cli", "serve an mlx-lm model (OpenAI API) and report every phase"),
    ("gateway", "tokentrace.engine_shim.gateway.cli", "route to OpenAI-compatible engines, observed from outside"),
    ("make-model", "tokentrace.engine_shim.mlx.make_model", "write a random-weight model to test and demo with"),
)


def build_parser() -> argparse.ArgumentParser:
    """The full parser; every command and subcommand has ``--help``."""
    parser = argparse.ArgumentParser(
        prog="tokentrace",
        description="Why was this LLM request slow, and why did the prefix cache miss?",
    )
    parser.add_argument("--version", action="version", version=f"tokentrace {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    for name, module_name, help_text in COMMANDS:
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the command, and map errors to exit codes (2: bad input, 1: failure)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ConfigError, NotFound) as exc:
        print(f"tokentrace {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except TokentraceError as exc:
        print(f"tokentrace {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
