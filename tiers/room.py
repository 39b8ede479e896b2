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
all are blocked the tier goes on in LRU order alone, as it did before, unless something
no eviction moves lies in the arena (a pin, a read, a slot) and no run of free and
evictable space is wide enough for the value: then it stops there (that order alone
had evicted every other value, then failed). That check scans every entry (77 ms for
100,000 here), so it runs only where every hole tried was blocked and something blocks
(with nothing in the way, LRU order alone always ends in room).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from kvpool.tiers.arena import Arena
from kvpool.tiers.ledger import Ledger, Record
from kvpool.tiers.tenants import TenantBytes

__all__ = ["LRU_BOUND", "MAX_SEEDS", "Places", "Room"]

#: bytes one reservation may evict in LRU order, in multiples of the value's extent
LRU_BOUND = 1
#: LRU victims tried as the seed of a hole by place
MAX_SEEDS = 32


class Placed(Protocol):
    @property
    def offset(self) -> int: ...

    @property
    def length(self) -> int: ...


class Evictable(Placed, Record, Protocol):
    @property
    def readers(self) -> int: ...

    @property
    def pinned(self) -> bool: ...

    @property
    def tenant(self) -> str | None: ...


E = TypeVar("E", bound=Placed)
V = TypeVar("V", bound=Evictable)


class Places(Generic[E]):
    """The live entries of an arena by where they start and end: what lies next to what."""

    __slots__ = ("_arena", "_ends", "_starts", "extents")

    def __init__(self, arena: Arena) -> None:
        self._arena = arena
        self._starts: dict[int, E] = {}
        self._ends: dict[int, E] = {}
        #: arena bytes of the entries placed (what the arena holds beyond them: slots
        #: being written, entries gone but still being read)
        self.extents = 0

    def add(self, entry: E) -> None:
        extent = Arena.extent(entry.length)
        self._starts[entry.offset] = entry
        self._ends[entry.offset + extent] = entry
        self.extents += extent

    def discard(self, entry: E) -> None:
        if self._starts.get(entry.offset) is entry:
            extent = Arena.extent(entry.length)
            del self._starts[entry.offset]
            del self._ends[entry.offset + extent]
            self.extents -= extent

    def widest(self, evictable: Callable[[E], bool]) -> int:
        """Bytes of the widest run of free extents and ``evictable`` entries, side by
        side: the biggest value any eviction could make room for (O(n log n): for the
        last resort only)."""
        pieces = [(start, size, True) for start, size in self._arena.free_extents()]
        pieces += [(e.offset, Arena.extent(e.length), evictable(e))
                   for e in self._starts.values()]
        pieces.sort()
        widest = run = end = 0
        for start, size, free in pieces:
            if not free:
                run = 0
                continue
            run = run + size if start == end and run else size
            end = start + size
            widest = max(widest, run)
        return widest

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


class Room(Generic[V]):
    """Room in an arena for one value, taken from a :class:`Ledger`'s eviction order:
    the first victim's extent as it lies where it is the value's (a tier of one chunk
    size: no free and no allocation), else its first victims up to ``LRU_BOUND`` times
    the value's extent, then a hole by place around one of the next, then that order
    alone (every hole blocked), unless something no eviction moves lies in the arena
    (pinned entries, ones being read, slots being written) and no run of free and
    evictable space is wide enough: then nothing more is evicted. ``evict`` drops one
    entry (the tier's bookkeeping); entries being read are never taken."""

    __slots__ = ("_arena", "_blocked", "_evict", "_hand_over", "_ledger", "_places")

    def __init__(self, arena: Arena, ledger: Ledger[V], places: Places[V], *,
                 evict: Callable[[V], None], blocked: Callable[[], bool],
                 hand_over: Callable[[V], None]) -> None:
        self._arena = arena
        self._ledger = ledger
        self._places = places
        self._evict = evict
        #: evicts an entry not being read and keeps its extent allocated (for a new value
        #: of the same extent: no free and no allocation between, :meth:`Arena.reuse`)
        self._hand_over = hand_over
        #: whether anything no eviction moves lies in the arena now: where so, the last
        #: resort first checks that a wide enough run exists (a scan of every entry;
        #: with nothing in the way, LRU order alone always ends in room)
        self._blocked = blocked

    def make(self, nbytes: int) -> int | None:
        """The offset of ``nbytes`` allocated in the arena, evicting as needed; None if
        nothing more can be evicted and they still do not fit."""
        arena = self._arena
        offset = arena.alloc(nbytes)
        if offset is not None:
            return offset
        size = arena.extent(nbytes)
        victim = self._next_victim()
        if victim is not None and arena.extent(victim.length) == size:
            # (most calls where chunks are of one size) the first victim's extent, whole
            self._hand_over(victim)
            return victim.offset
        budget = LRU_BOUND * size
        by_place = True
        while offset is None:
            if budget <= 0 and by_place:  # eviction order made no hole within its budget
                by_place = False
                offset = self._hole(nbytes)
                if offset is None and self._blocked() \
                        and self._places.widest(_evictable) < size:
                    break  # no eviction makes the room: refused, nothing more evicted
                continue
            if victim is None:  # (the first is the one found above, not looked up again)
                victim = self._next_victim()  # (every hole blocked: eviction order alone)
                if victim is None:
                    break
            self._evict(victim)
            budget -= arena.extent(victim.length)
            victim = None
            offset = arena.alloc(nbytes)
        return offset

    def within_quota(self, tenants: TenantBytes, tenant: str, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit ``tenant``'s quota once its own entries not being
        read are evicted, in eviction order, as needed (counted in ``tenants``); if they
        never would, nothing is evicted."""
        need = tenants.excess(tenant, nbytes)
        if not need:  # 0: fits; None: never fits
            return need == 0
        records = self._ledger.records
        victims = []
        for key in self._ledger.candidates():
            entry = records[key]
            if entry.tenant == tenant and entry.readers == 0:
                victims.append(entry)
                need -= entry.length
                if need <= 0:
                    break
        else:
            return False
        for victim in victims:
            self._evict(victim)
        tenants.evictions += len(victims)
        return True

    def _hole(self, nbytes: int) -> int | None:
        """Evict a contiguous run of entries around one of the next victims, room for
        ``nbytes``; its offset, or None."""
        records = self._ledger.records
        victims = self._places.hole((records[k] for k in self._ledger.candidates()),
                                    self._arena.extent(nbytes), _evictable)
        for victim in victims or ():
            self._evict(victim)
        return self._arena.alloc(nbytes) if victims is not None else None

    def _next_victim(self) -> V | None:
        records = self._ledger.records
        first = self._ledger.first()
        if first is not None and records[first].readers == 0:  # (most calls)
            return records[first]
        return next((e for k in self._ledger.candidates() if (e := records[k]).readers == 0),
                    None)


def _evictable(entry: Evictable) -> bool:
    return entry.readers == 0 and not entry.pinned
