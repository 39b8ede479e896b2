"""Where a tier reports the chunks it let go of by itself: a sink its owner listens on.

A tier drops chunks nobody asked it to drop: to make room (its capacity, a tenant's
quota) or because a TTL passed. Each tier has a :class:`TierEvents` from birth and
reports there, whoever owns it; the owner (the node's ``TierManager``) listens once.
With no listener a report is dropped. Deletes, overwrites and moves a caller asked for
are not reported: the caller knows them.
"""

from __future__ import annotations

from typing import Literal, Protocol

__all__ = ["Why", "TierEvents", "TierListener"]

#: why a chunk went: ``room`` (made for another), ``ttl`` (its time-to-live passed)
Why = Literal["room", "ttl"]


class TierListener(Protocol):
    def dropped(self, tier: str, key: bytes, why: Why, entry: object) -> None:
        """``tier`` let ``key`` go for ``why``; ``entry`` is what the tier held of it
        (the DRAM tier's ``Entry``; None where the tier keeps no record, as below DRAM)."""


class TierEvents:
    """One tier's reports. ``tier`` names it in every report."""

    __slots__ = ("_listener", "tier")

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._listener: TierListener | None = None

    def listen(self, listener: TierListener) -> None:
        """Send every later report to ``listener``; a tier has one owner, so a second
        listener is a wiring mistake (ValueError)."""
        if self._listener is not None and self._listener is not listener:
            raise ValueError(f"the {self.tier} tier already reports to {self._listener!r}")
        self._listener = listener

    def dropped(self, key: bytes, why: Why, entry: object = None) -> None:
        listener = self._listener
        if listener is not None:
            listener.dropped(self.tier, key, why, entry)
