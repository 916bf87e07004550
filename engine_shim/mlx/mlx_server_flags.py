"""Every option of ``mlx_lm.server`` (mlx-lm 0.32), and what ``tokentrace engine`` does with it.

A user replacing ``mlx_lm.server`` keeps their command line: each of its options is either one of
our settings (same name, or the alias in ``settings.ALIASES``), accepted without effect where it
has none in mlx_lm.server either, or refused in one line that says why and names our equivalent.
tests/test_engine_compat.py reads the installed mlx_lm.server's own argparse, so an option added
there fails until it is listed here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from tokentrace.engine_shim.mlx.settings import ALIASES, SETTINGS
from tokentrace.errors import ConfigError


@dataclass(frozen=True)
class Refused:
    """An mlx_lm.server option the engine does not support."""

    message: str  #: why, and what to use instead
    takes_value: bool = True  #: the option takes an argument (else it is a flag)


@dataclass(frozen=True)
class Ignored:
    """An option accepted with no effect, because it has none without another refused option."""

    reason: str  #: why it changes nothing
    takes_value: bool = True  #: the option takes an argument


#: mlx_lm.server options that are not settings of ours (they are listed in docs/engine.md).
OTHER_OPTIONS: dict[str, Refused | Ignored] = {
    "draft-model": Refused(
        "--draft-model: speculative decoding is not supported: mlx-lm's BatchGenerator, which tokentrace "
        "engine batches with, takes no draft model (mlx_lm.server serves such requests one at a time); "
        "serve without it, or put `tokentrace gateway` in front of mlx_lm.server to observe it from outside"),
    "num-draft-tokens": Ignored("only used with --draft-model, which is refused"),
    "kv-bits": Refused(
        "--kv-bits: KV-cache quantization is not supported: quantized caches cannot be batched by "
        "BatchGenerator (mlx_lm.server serves them one at a time); bound memory with --cache-max-bytes, "
        "or put `tokentrace gateway` in front of mlx_lm.server"),
    "kv-group-size": Ignored("only used with --kv-bits, which is refused"),
    "quantized-kv-start": Ignored("only used with --kv-bits, which is refused"),
}


def mapping() -> dict[str, str]:
    """Each mlx_lm.server option (without dashes) -> 'setting --x', 'refused' or 'ignored'."""
    ours = {setting.option for setting in SETTINGS}
    table = {option: f"setting --{option}" for option in ours}
    table.update({theirs: f"setting --{mine}" for theirs, mine in ALIASES.items()})
    table.update({option: type(kind).__name__.lower() for option, kind in OTHER_OPTIONS.items()})
    table["pipeline"] = "setting --parallel pipeline"
    return table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Accept the refused and ignored options, so that they are reported in our words."""
    parser.add_argument("--pipeline", dest="mlx_pipeline", action="store_true", default=False,
                        help="mlx_lm.server's name for --parallel pipeline (a distributed engine splits its layers)")
    group = parser.add_argument_group("mlx_lm.server options without an equivalent (see docs/engine.md)")
    for option, kind in OTHER_OPTIONS.items():
        dest = "mlx_" + option.replace("-", "_")
        if kind.takes_value:
            group.add_argument(f"--{option}", dest=dest, default=None, help=argparse.SUPPRESS)
        else:
            group.add_argument(f"--{option}", dest=dest, action="store_true", default=None, help=argparse.SUPPRESS)


def check(args: argparse.Namespace) -> list[str]:
    """Raise ConfigError for a refused option given; return a warning per ignored one given."""
    warnings = []
    for option, kind in OTHER_OPTIONS.items():
        if getattr(args, "mlx_" + option.replace("-", "_"), None) is None:
            continue
        if isinstance(kind, Refused):
            raise ConfigError(kind.message)
        warnings.append(f"--{option} has no effect: {kind.reason}")
    return warnings
