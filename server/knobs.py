"""Knobs: a setting declared once (default, help, flag, environment variable) as a field
of a frozen dataclass section, and everything read off those declarations: the
``--help`` flags, the docs table, and the values of a TOML file, then ``KVPOOL_*``
variables, then flags, each converted and checked on the way in.

Generic over sections: :mod:`kvpool.server.config` says which sections a node has.
Sizes accept ``"8GiB"``, ``"512MiB"``, ``"64MB"`` or plain bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvpool.protocol.errors import ConfigError

__all__ = ["Sections", "add_arguments", "format_size", "knob", "knob_table", "known_env",
           "parse_size", "read_values"]

#: section name ([server], [dram], ...) -> its frozen dataclass of knobs
Sections = Mapping[str, type[Any]]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "ki": 2**10, "kib": 2**10,
          "m": 10**6, "mb": 10**6, "mi": 2**20, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gi": 2**30, "gib": 2**30,
          "t": 10**12, "tb": 10**12, "ti": 2**40, "tib": 2**40}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_size(value: str | int) -> int:
    """``"8GiB"`` -> 8589934592. Plain ints are bytes."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(value)
    if not m:
        raise ConfigError(f"not a size: {value!r} (try 512MiB, 8GiB or a byte count)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def knob(default: Any, help: str, *, flag: str, env: str, kind: str = "") -> Any:
    """A dataclass field that is a knob (``kind``: "size", "bool", or "" for its type)."""
    return dataclasses.field(default=default,
                             metadata={"flag": flag, "env": env, "help": help, "kind": kind})


def _convert(section: str, f: dataclasses.Field[Any], raw: Any, origin: str) -> Any:
    try:
        if f.metadata.get("kind") == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text not in _TRUE + _FALSE:
                raise ValueError("expected true or false")
            return text in _TRUE
        if f.metadata.get("kind") == "size":
            return parse_size(raw)
        if f.type in ("int", int):
            return int(raw)
        if f.type in ("float", float):
            return float(raw)
        return str(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{origin}: bad value {raw!r} for {section}.{f.name}: {exc}") from None


def knob_table(sections: Sections) -> str:
    """Every knob as Markdown table rows (docs/configuration.md's table)."""
    rows = []
    for section, cls in sections.items():
        for f in dataclasses.fields(cls):
            meta = f.metadata
            default: Any = f.default
            shown = format_size(default) if meta["kind"] == "size" and default else repr(default)
            flag = f"{meta['flag']}/--no-{meta['flag'][2:]}" if meta["kind"] == "bool" \
                else meta["flag"]
            rows.append(f"| `{section}.{f.name}` | `{flag}` | `{meta['env']}` | {shown} "
                        f"| {meta['help']} |")
    return "\n".join(rows)


def add_arguments(parser: argparse.ArgumentParser, sections: Sections) -> None:
    """One flag per knob, in a group per section; its help names the default and the
    environment variable."""
    for section, cls in sections.items():
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(cls):
            meta = f.metadata
            default: Any = f.default
            shown = format_size(default) if meta["kind"] == "size" and default else default
            helptext = f"{meta['help']} (default: {shown!r}; env: {meta['env']})"
            if meta["kind"] == "bool":
                group.add_argument(meta["flag"], dest=f"{section}.{f.name}", default=None,
                                   action=argparse.BooleanOptionalAction, help=helptext)
            else:
                group.add_argument(meta["flag"], dest=f"{section}.{f.name}", default=None,
                                   metavar=f.name.upper(), help=helptext)


def known_env(sections: Sections) -> set[str]:
    """The ``KVPOOL_*`` variable of every knob, and its ``_FILE`` form."""
    names = {f.metadata["env"] for cls in sections.values() for f in dataclasses.fields(cls)}
    return names | {name + FILE_SUFFIX for name in names}


#: ``KVPOOL_X_FILE=path`` sets knob ``KVPOOL_X`` to the file's content (Docker's
#: convention for secrets: a token or password in no environment and no command line)
FILE_SUFFIX = "_FILE"


def _read_secret(path: str) -> str:
    try:
        return Path(path).read_text().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


def read_values(sections: Sections, path: str | None, env: Mapping[str, str],
                args: argparse.Namespace | None) -> dict[str, dict[str, Any]]:
    """Per section, the knobs set by the TOML file at ``path``, then by ``env``, then by
    the flags in ``args`` (each later one wins), converted; ConfigError names the origin
    of a bad value or an unknown section or key."""
    values: dict[str, dict[str, Any]] = {name: {} for name in sections}
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        for section, table in data.items():
            cls = sections.get(section)
            if cls is None or not isinstance(table, dict):
                raise ConfigError(f"{path}: unknown section [{section}]")
            known = {f.name: f for f in dataclasses.fields(cls)}
            for key, raw in table.items():
                if key not in known:
                    raise ConfigError(f"{path}: unknown key {section}.{key}")
                values[section][key] = _convert(section, known[key], raw, path)
    for section, cls in sections.items():
        for f in dataclasses.fields(cls):
            name = f.metadata["env"]
            raw, origin = env.get(name), name
            if env.get(name + FILE_SUFFIX) is not None:
                if raw is not None:
                    raise ConfigError(f"set {name} or {name}{FILE_SUFFIX}, not both")
                raw, origin = _read_secret(env[name + FILE_SUFFIX]), name + FILE_SUFFIX
            if raw is not None:
                values[section][f.name] = _convert(section, f, raw, origin)
            flag_value = getattr(args, f"{section}.{f.name}", None) if args else None
            if flag_value is not None:
                values[section][f.name] = _convert(section, f, flag_value, f.metadata["flag"])
    return values
