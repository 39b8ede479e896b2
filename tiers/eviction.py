"""Eviction order: least recently used first; at equal recency, deepest first.

A chunk is useless without its ancestors, so when several chunks are touched
by one request (a prefix stored or loaded together, hence equally recent),
the deeper ones become eviction candidates before their parents. The policy
is an ``OrderedDict`` (O(1) per touch): a batch is appended deepest-first, so
its shallowest chunk ends up the most recent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

__all__ = ["PrefixAwareLRU"]


class PrefixAwareLRU:
    """Tracks evictable keys; ``candidates()`` yields them in eviction order."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: bytes) -> bool:
        return key in self._order

    def touch(self, batch: Iterable[tuple[bytes, int]]) -> None:
        """Mark ``(key, depth)`` pairs as used now, together (adds unknown keys)."""
        order = self._order
        for key, _depth in sorted(batch, key=lambda kd: -kd[1]):
            order[key] = None
            order.move_to_end(key)

    def discard(self, key: bytes) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[bytes]:
        """Keys from first to last to evict. Do not mutate while iterating."""
        return iter(self._order)
