"""The settings table every shim's command line is built from (STYLE §15): one row per setting
(option, type, default, environment variable, help), turned into CLI options and read back as
option, else environment variable, else default, each value checked in one clear line.

The MLX engine and the gateway each keep their own table (their own environment prefix, their own
cross-setting checks); what a row means and how a value is read is written once, here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tokentrace.errors import ConfigError

#: How a setting's own conversion reads one raw value (text from the command line or environment):
#: (setting, raw, source) -> value; raises ValueError/TypeError for a value of the wrong kind.
Convert = Callable[["Setting", Any, str], Any]

_KINDS = {int: "an integer", float: "a number", str: "text"}


@dataclass(frozen=True)
class Setting:
    """One setting of a shim."""

    option: str  #: CLI option without the leading dashes
    type: type  #: str, int, float, bool (a flag) or list (a repeatable NAME=VALUE option)
    default: Any  #: value when neither the option nor the environment variable is given
    help: str  #: one line for --help and docs
    minimum: float | None = None  #: smallest accepted value for numbers
    maximum: float | None = None  #: largest accepted value for numbers
    choices: tuple[str, ...] = ()  #: accepted values for text, when closed
    prefix: str = "TOKENTRACE_ENGINE_"  #: environment variable prefix of the table the setting is in

    @property
    def env(self) -> str:
        """Environment variable that sets the default, e.g. TOKENTRACE_ENGINE_MAX_BATCH."""
        return self.prefix + self.option.upper().replace("-", "_")

    @property
    def attr(self) -> str:
        """Attribute name on the settings object."""
        return self.option.replace("-", "_")


def add_arguments(parser: argparse.ArgumentParser, settings: Iterable[Setting],
                  aliases: Mapping[str, str] | None = None) -> None:
    """One option per setting (plus other names for it: ``aliases`` maps theirs to ours);
    environment variables provide the defaults."""
    others: dict[str, list[str]] = {}
    for theirs, ours in (aliases or {}).items():
        others.setdefault(ours, []).append(f"--{theirs}")
    for setting in settings:
        help_text = f"{setting.help} [env {setting.env}]"
        names = [f"--{setting.option}", *others.get(setting.option, [])]
        if setting.type is bool:
            parser.add_argument(*names, dest=setting.attr, action="store_true", default=None, help=help_text)
        elif setting.type is list:
            parser.add_argument(*names, dest=setting.attr, action="append", default=None, metavar="NAME=VALUE",
                                help=help_text)
        else:
            shown = "" if setting.default is None else f" (default: {setting.default})"
            if setting.choices:  # listed where a reader looks for them: "--route {round_robin,...}" and the help
                shown = f": one of {', '.join(setting.choices)}{shown}"
            parser.add_argument(*names, dest=setting.attr, default=None, choices=setting.choices or None,
                                metavar=None if setting.choices else setting.option.upper().replace("-", "_"),
                                help=help_text + shown)


def read_values(args: argparse.Namespace, settings: Iterable[Setting], environ: Mapping[str, str],
                convert: Convert | None = None) -> dict[str, Any]:
    """Each setting's value: the option, else its environment variable (a list: comma-separated),
    else the default; every given value checked (ConfigError naming where it came from)."""
    values: dict[str, Any] = {}
    for setting in settings:
        raw = getattr(args, setting.attr, None)
        source = f"--{setting.option}"
        if raw is None and setting.env in environ:
            raw, source = environ[setting.env], setting.env
            if setting.type is list:
                raw = [part for part in raw.split(",") if part.strip()]
        values[setting.attr] = setting.default if raw is None else parse_value(setting, raw, source, convert)
    return values


def parse_value(setting: Setting, raw: Any, source: str, convert: Convert | None = None) -> Any:
    """One value of ``setting``: a flag's words, a number's kind and minimum, a closed choice;
    ``convert`` reads values whose syntax is the table's own (sizes, NAME=VALUE pairs)."""
    if setting.type is list:
        return tuple(convert(setting, item, source) if convert else item for item in raw)
    if setting.type is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{source} must be true or false, received {raw!r}")
    try:
        value = convert(setting, raw, source) if convert else setting.type(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{source} must be {_KINDS[setting.type]}, received {raw!r}") from None
    if setting.minimum is not None and value < setting.minimum:
        raise ConfigError(f"{source} must be {_KINDS[setting.type]} >= {setting.minimum:g}, received {raw!r}")
    if setting.maximum is not None and value > setting.maximum:
        raise ConfigError(f"{source} must be {_KINDS[setting.type]} <= {setting.maximum:g}, received {raw!r}")
    if setting.choices and value not in setting.choices:
        raise ConfigError(f"{source} must be one of {', '.join(setting.choices)}, received {raw!r}")
    return value
