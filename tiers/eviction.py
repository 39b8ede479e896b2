"""Eviction order: least recently used first; at equal recency, deepest first. And
expiry order: soonest deadline first (:class:`Deadlines`).

A chunk is useless without its ancestors, so when several chunks are touched
by one request (a prefix stored or loaded together, hence equally recent),
the deeper ones become eviction candidates before their parents. The policy
is an ``OrderedDict`` (O(1) per touch): a batch is appended deepest-first, so
its shallowest chunk ends up the most recent.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

__all__ = ["Deadlines", "PrefixAwareLRU"]

T = TypeVar("T")


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


class Deadlines(Generic[T]):
    """Items by deadline, soonest first (a heap). An item whose deadline changed, or that
    went away, stays in it until it comes up: the caller checks it then."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._seq = itertools.count()  # ties never compare the items

    def add(self, at: float, item: T) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), item))

    @property
    def next_at(self) -> float:
        """The soonest deadline (inf when none): nothing is due before it."""
        heap = self._heap
        return heap[0][0] if heap else math.inf

    def due(self, now: float) -> Iterator[tuple[float, T]]:
        """Take out the items whose deadline is ``now`` or past, soonest first."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, _, item = heapq.heappop(heap)
            yield at, item
