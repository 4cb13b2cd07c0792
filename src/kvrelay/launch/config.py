"""Options of the process faces: command-line flags, then ``KVRELAY_*`` variables, then a TOML file.

Contract:
- Each ``Option`` has a name (``worker_port``), a flag (``--worker-port``), an
  environment variable (``KVRELAY_WORKER_PORT``) and a key in the command's
  table of the TOML file (``[router] worker_port = 8001``). ``resolve`` takes,
  per option, the first of: the flag when given, the variable when set and
  non-empty, the TOML key when present, the default. Nothing else is read.
- The TOML file is ``--config PATH`` or ``$KVRELAY_CONFIG``; only its
  ``[<command>]`` table is read (``[router]``, ``[worker]``, ``[cluster]``), so
  one file can configure every face.
- A repeated option (``--router URL --router URL``) is a list: a flag given
  several times, a comma-separated variable, or a TOML array.
- A bad value, an unreadable file or an unknown key raises ``ConfigError``
  naming where the value came from and what is expected.
- ``add_options`` registers the flags (their help text names the variable, the
  TOML key and the default) without argparse defaults, so a flag that was not
  given is ``None`` and the lower sources can fill it.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_ENV = "KVRELAY_CONFIG"
ENV_PREFIX = "KVRELAY_"


class ConfigError(ValueError):
    """An option value that cannot be used; the message names its source."""


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_bool(text: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off, any case): the parser of a switch option."""
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError("expected true or false")


@dataclass(frozen=True, slots=True)
class Option:
    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    repeated: bool = False
    choices: tuple[str, ...] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


def add_options(parser: argparse.ArgumentParser, command: str, options: Sequence[Option]) -> None:
    """Register ``--config`` and one flag per option (see the module contract)."""
    parser.add_argument(
        "--config",
        default=None,
        metavar="PATH",
        help=f"TOML file whose [{command}] table sets options (env {CONFIG_ENV}); "
        "precedence: flag > environment variable > TOML > default",
    )
    for option in options:
        default = ", ".join(option.default) if option.repeated else option.default
        default = "none" if default in (None, "") else default
        text = f"{option.help} (env {option.env}; TOML {command}.{option.name}; default {default})"
        parser.add_argument(
            option.flag,
            dest=option.name,
            default=None,
            metavar=option.name.upper(),
            action="append" if option.repeated else "store",
            help=text,
            choices=option.choices,
        )


def resolve(
    args: argparse.Namespace, command: str, options: Sequence[Option], environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Each option's value by precedence flag > ``KVRELAY_*`` > TOML ``[command]`` > default."""
    env = os.environ if environ is None else environ
    table = _toml_table(getattr(args, "config", None) or env.get(CONFIG_ENV) or None, command, options)
    values: dict[str, Any] = {}
    for option in options:
        given = getattr(args, option.name, None)
        if given is not None:
            values[option.name] = (
                [_parse(option, v, option.flag) for v in given]
                if option.repeated
                else _parse(option, given, option.flag)
            )
        elif env.get(option.env):
            raw = env[option.env]
            source = f"${option.env}"
            values[option.name] = (
                [_parse(option, v.strip(), source) for v in raw.split(",") if v.strip()]
                if option.repeated
                else _parse(option, raw, source)
            )
        elif option.name in table:
            values[option.name] = table[option.name]
        else:
            values[option.name] = (
                list(option.default) if option.repeated and option.default is not None else option.default
            )
    return values


def _parse(option: Option, raw: Any, source: str) -> Any:
    try:
        value = option.parse(raw) if isinstance(raw, str) else raw
    except ValueError as exc:
        raise ConfigError(f"{source}={raw!r} is not a valid {option.name}: {exc}") from None
    if option.choices is not None and value not in option.choices:
        raise ConfigError(f"{source}={raw!r} is not one of {', '.join(option.choices)}")
    return value


def _toml_table(path: str | None, command: str, options: Sequence[Option]) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        document = tomllib.loads(Path(path).expanduser().read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path!r}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the config file {path!r} is not valid TOML: {exc}") from None
    table = document.get(command, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{command} in the config file {path!r} must be a table: [{command}]")
    known = {o.name: o for o in options}
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(unknown)} in [{command}] of {path!r}; known keys: {', '.join(sorted(known))}"
        )
    values: dict[str, Any] = {}
    for key, raw in table.items():
        option = known[key]
        source = f"{command}.{key} in {path!r}"
        if option.repeated:
            items = raw if isinstance(raw, list) else [raw]
            values[key] = [_parse(option, _as_text(i), source) for i in items]
        else:
            values[key] = _parse(option, _as_text(raw), source)
    return values


def _as_text(raw: Any) -> str:
    """TOML values go through the same parser as flags, so ``port = "80"`` and ``port = 80`` agree."""
    return raw if isinstance(raw, str) else str(raw)
