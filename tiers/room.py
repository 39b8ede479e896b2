"""Room for a value that least-recently-used eviction cannot make: a hole by place.

Evicting the least recently used entries frees memory scattered over the arena.
When they are much smaller than the value to store, a free extent big enough may
form only once most of the arena is gone: a 1 MiB reservation in a 64 MiB arena of
4 KiB values read in random order evicted 15,941 entries (62 MiB, the whole cache)
in 193 ms, one event-loop stall. So the DRAM tier's LRU eviction for one
reservation stops after ``LRU_BOUND`` times the value's extent, and room is then
made by place: around one of the next LRU victims (the seed), the free extents and
evictable entries next to it are taken until they span the value's extent. At most
``MAX_SEEDS`` seeds are tried; a hole blocked on both sides (a pinned entry, one
being read, a slot being written, the arena's ends) tries the next seed, and when
all are blocked the tier goes on in LRU order alone, as it did before.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from kvpool.tiers.arena import Arena

__all__ = ["LRU_BOUND", "MAX_SEEDS", "Places"]

#: bytes one reservation may evict in LRU order, in multiples of the value's extent
LRU_BOUND = 1
#: LRU victims tried as the seed of a hole by place
MAX_SEEDS = 32


class Placed(Protocol):
    @property
    def offset(self) -> int: ...

    @property
    def length(self) -> int: ...


E = TypeVar("E", bound=Placed)


class Places(Generic[E]):
    """The live entries of an arena by where they start and end: what lies next to what."""

    __slots__ = ("_arena", "_ends", "_starts")

    def __init__(self, arena: Arena) -> None:
        self._arena = arena
        self._starts: dict[int, E] = {}
        self._ends: dict[int, E] = {}

    def add(self, entry: E) -> None:
        self._starts[entry.offset] = entry
        self._ends[entry.offset + Arena.extent(entry.length)] = entry

    def discard(self, entry: E) -> None:
        if self._starts.get(entry.offset) is entry:
            del self._starts[entry.offset]
            del self._ends[entry.offset + Arena.extent(entry.length)]

    def hole(self, seeds: Iterable[E], size: int, evictable: Callable[[E], bool]
             ) -> list[E] | None:
        """Entries to evict for ``size`` contiguous bytes: a hole around the first of
        (at most ``MAX_SEEDS``) ``seeds`` that can make one; None if none can."""
        for seed in itertools.islice(seeds, MAX_SEEDS):
            if evictable(seed):
                victims = self.hole_around(seed, size, evictable)
                if victims is not None:
                    return victims
        return None

    def hole_around(self, seed: E, size: int, evictable: Callable[[E], bool]) -> list[E] | None:
        """Entries to evict, ``seed`` first, after which they and the free extents between
        them span ``size`` contiguous bytes; None if a hole around ``seed`` is blocked
        before it is that big. Grows to higher offsets first, then lower."""
        arena = self._arena
        lo, hi = seed.offset, seed.offset + Arena.extent(seed.length)
        taken = [seed]
        while hi - lo < size:
            if hi < arena.capacity:
                if free := arena.free_extent_at(hi):
                    hi += free
                    continue
                after = self._starts.get(hi)
                if after is not None and evictable(after):
                    taken.append(after)
                    hi += Arena.extent(after.length)
                    continue
            if lo > 0:
                if free := arena.free_extent_ending_at(lo):
                    lo -= free
                    continue
                before = self._ends.get(lo)
                if before is not None and evictable(before):
                    taken.append(before)
                    lo = before.offset
                    continue
            return None
        return taken
