"""An engine adapter's settings from the engine's config: one line naming what is wrong.

The vLLM connector, the SGLang backend and the LMCache plugin each read a frozen
dataclass of settings out of a dict their engine hands over; :func:`settings_from`
checks it the same way for all three.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, TypeVar

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
    try:
        settings = cls(**values)
    except TypeError as exc:
        raise ConfigError(f"{owner}: {exc}") from None
    for name in seconds:
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{owner}: {shown(name)} must be > 0, got {value!r}")
    return settings
