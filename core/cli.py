"""The one CLI group, ``tokentrace``. Only ``main()`` exits.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
modules import their heavy dependencies inside ``run`` so that ``--help`` stays instant. A command
line that names a command imports only that command's module (``tokentrace analyze ... --url`` must
not pay for the engine's or the collector's imports; issue 17); without one, every module is
imported so that ``tokentrace --help`` and the docs checks see them all.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from tokentrace import __version__
from tokentrace.errors import TokentraceError

#: (command, module, one-line help). The order is the order of ``tokentrace --help``.
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("collector", "tokentrace.collector.cli", "run the OTLP collector, its DuckDB store and dashboard"),
    ("analyze", "tokentrace.analyzers.cli", "verdicts: why a request was slow, why its cache lookup missed"),
    ("whatif", "tokentrace.analyzers.whatif_cli", "replay traffic through other cache sizes, instances and routing"),
    ("export", "tokentrace.dashboards.export_cli", "traces for other tools: Perfetto JSON, Mooncake traces"),
    ("store", "tokentrace.collector.stores.store_cli", "check a stopped collector's DuckDB store, or repair it"),
    ("demo", "tokentrace.demo", "run the whole story on this machine on a tiny generated model"),
    ("engine", "tokentrace.engine_shim.mlx.cli", "serve an mlx-lm model (OpenAI API) and report every phase"),
    ("gateway", "tokentrace.engine_shim.gateway.cli", "route to OpenAI-compatible engines, observed from outside"),
    ("make-model", "tokentrace.engine_shim.mlx.make_model", "write a random-weight model to test and demo with"),
)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser; every command and subcommand has ``--help``.

    With ``only`` (a command name), the other commands get an empty parser (their name and help line
    only, enough for ``tokentrace --help`` and for argparse's choice check) and their modules are
    not imported.
    """
    parser = argparse.ArgumentParser(
        prog="tokentrace",
        description="Why was this LLM request slow, and why did the prefix cache miss?",
    )
    parser.add_argument("--version", action="version", version=f"tokentrace {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    for name, module_name, help_text in COMMANDS:
        if only is not None and name != only:
            commands.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_name)
        # Docstrings are written for Sphinx-like readers: drop the ``literal`` marks, keep their line
        # breaks (examples stay on their own lines).
        sub = commands.add_parser(name, help=help_text, description=(module.__doc__ or "").replace("``", ""),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def _named_command(argv: list[str]) -> str | None:
    """The command the line names (its first word, when it is one of ours), else None."""
    first = argv[0] if argv else None
    return first if any(first == name for name, _, _ in COMMANDS) else None


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the command, and map errors to their exit codes (core/errors.py)."""
    parser = build_parser(_named_command(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    try:
        code = int(args._run(args) or 0)
    except TokentraceError as exc:
        print(f"tokentrace {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader stopped early (| head -1): no traceback, as _leave
        _stdout_gone()
        return PIPE_CLOSED
    if argv is None and getattr(args, "_quick_exit", False):
        _leave(code)
    return code


def _leave(code: int) -> NoReturn:
    """Exit now, without the interpreter's teardown, for a command that has printed its answer and
    holds nothing open (``analyze``): unloading modules and DuckDB's buffers cost 30 ms at the median
    and up to 90 ms of a 260 ms cache verdict at 1.25M requests (measured). Only the real command
    line leaves this way; ``main(argv)`` from Python returns."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # a reader that stopped early (| head): as Python itself reports it
        os._exit(PIPE_CLOSED)
    os._exit(code)


#: Exit status when stdout's reader went away before the answer was written (Python's own status
#: when flushing stdout fails at exit).
PIPE_CLOSED = 120


def _stdout_gone() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush of what is still buffered
    cannot fail again (and print "Exception ignored ... BrokenPipeError")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
