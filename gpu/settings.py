"""An engine adapter's settings from the engine's config: one line naming what is wrong.

The vLLM connector, the SGLang backend and the LMCache plugin each read a frozen
dataclass of settings out of a dict their engine hands over; :func:`settings_from`
checks it the same way for all three.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from kvpool.protocol.errors import ConfigError

__all__ = ["settings_from"]

T = TypeVar("T")


def settings_from(cls: type[T], values: dict[str, Any], *, owner: str, keys: str,
                  missing_url: str, url_field: str = "kvpool_url",
                  seconds: Sequence[str] = ("timeout_s", "retry_after_s"),
                  shown: Callable[[str], str] = str) -> T:
    """``cls(**values)``, or ConfigError ``"<owner>: ..."`` for an unknown key (``keys``
    says what they are), no ``url_field`` (``missing_url`` says what to do), a value of
    the wrong type, or a ``seconds`` field that is not > 0. ``shown``: how a field is
    named in the engine's config."""
    known = sorted(f.name for f in fields(cls))  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{owner}: unknown {keys} {[shown(k) for k in unknown]}; known: "
                          f"{[shown(k) for k in known]}")
    if not isinstance(values.get(url_field), str) or not values[url_field]:
        raise ConfigError(f"{owner}: {missing_url}")
    hints = get_type_hints(cls)
    for name, value in values.items():
        if not _fits(value, hints[name]):
            raise ConfigError(f"{owner}: {shown(name)} must be {_describe(hints[name])}, got "
                              f"{value!r} ({type(value).__name__})")
    try:
        settings = cls(**values)
    except TypeError as exc:
        raise ConfigError(f"{owner}: {exc}") from None
    for name in seconds:
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{owner}: {shown(name)} must be > 0, got {value!r}")
    return settings


def _fits(value: Any, hint: Any) -> bool:
    """Whether a value from an engine's (JSON or YAML) config is of a setting's type: no
    string for a bool, no bool for a number, an int where a float goes."""
    if get_origin(hint) in (Union, types.UnionType):
        return any(_fits(value, arm) for arm in get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # a type this check does not know: the dataclass takes it as it is


def _describe(hint: Any) -> str:
    if get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_describe(arm) for arm in get_args(hint))
    names = {type(None): "null", bool: "true or false", str: "a string", float: "a number",
             int: "an integer"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))
