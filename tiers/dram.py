"""DRAM tier: chunks live in one preallocated arena, indexed by key.

The node receives PUT values straight into arena slots (``reserve`` then
``commit``) and sends GET values as memoryviews of the arena (``acquire`` then
``release``). An acquired entry is never evicted, and if it is deleted or
overwritten meanwhile its extent is freed only after the last release, so a
chunk being sent is never overwritten mid-send.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpool.protocol.envelope import Codec, EnvelopeHeader
from kvpool.protocol.errors import CorruptChunkError
from kvpool.protocol.shm_index import IndexSlot
from kvpool.tiers.arena import ALIGN, Arena
from kvpool.tiers.arena_index import ArenaIndex
from kvpool.tiers.base import TierStats
from kvpool.tiers.events import TierEvents
from kvpool.tiers.eviction import Deadlines
from kvpool.tiers.ledger import Ledger
from kvpool.tiers.room import Places, Room
from kvpool.tiers.tenants import TenantBytes

__all__ = ["DramTier", "Entry", "Slot"]

Clock = Callable[[], float]


@dataclass(slots=True, eq=False)
class Entry:
    key: bytes
    offset: int
    length: int
    depth: int
    expires_at: float | None = None
    pinned: bool = False
    readers: int = 0
    live: bool = True
    parent: bytes | None = None  #: the previous chunk of the prefix, when the writer said
    num_tokens: int = 0  #: tokens the chunk holds (from its envelope)
    last_access: float = 0.0  #: wall-clock time of its last PUT or GET
    tenant: str | None = None  #: whose quota the chunk counts against (None: no one's)
    checksum: int = -1  #: its envelope's payload checksum (-1: not a raw value)
    #: read or looked up since stored, or stored again after an eviction (the eviction
    #: policy remembered it): what ``--ssd-admit reused`` writes below
    reused: bool = False
    queued_below: bool = False  #: written behind to the tier below (or on its way)


def _index_slot(entry: Entry, arena: Arena, now: float) -> IndexSlot:
    """What the arena index says of ``entry`` to co-located clients (``now``: the tier's
    clock; its TTL is published as a wall-clock deadline, which every process reads
    alike)."""
    expires = 0.0 if entry.expires_at is None else time.time() + (entry.expires_at - now)
    return IndexSlot(entry.key, entry.offset, entry.length, arena.gens[entry.offset // ALIGN],
                     entry.checksum, expires)


class Slot:
    """Arena memory reserved for one incoming value (a parser Reservation)."""

    __slots__ = ("_tier", "committed", "key", "length", "offset", "tenant", "view")

    def __init__(self, tier: DramTier, key: bytes, offset: int, length: int,
                 tenant: str | None = None) -> None:
        self._tier = tier
        self.key = key
        self.offset = offset
        self.length = length
        self.tenant = tenant
        self.view = tier.arena.view[offset : offset + length]
        self.committed = False

    def assign(self, key: bytes, tenant: str | None) -> None:
        """The slot's final key and owner (the node learns them after parsing)."""
        self.key = key
        if self.tenant != tenant and not self.committed:
            self._tier.tenants.charge(self.tenant, -self.length)
            self._tier.tenants.charge(tenant, self.length)
            self.tenant = tenant

    def release(self) -> None:
        """Give the memory back (a frame that never completed). No-op once committed."""
        if not self.committed:
            self.committed = True
            self.view.release()
            self._tier.arena.free(self.offset, self.length)
            self._tier.tenants.charge(self.tenant, -self.length)


class _ZeroCopy(Protocol):
    def acquire_many(self, keys: Sequence[bytes]) -> list[Entry | None]: ...
    def view(self, entry: Entry) -> memoryview: ...
    def release(self, entry: Entry) -> None: ...
    def reserve(self, key: bytes, nbytes: int, tenant: str | None = None) -> Slot | None: ...
    def commit(self, slots: Sequence[Slot]) -> list[Entry | None]: ...
    def delete_many(self, keys: Sequence[bytes]) -> list[bool]: ...
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...


class _Copies:
    """The narrow Tier interface (``tiers/base.py``) over the zero-copy calls: values as
    copies, one key a call; for tiers and tools, not the data path."""

    def get(self: _ZeroCopy, key: bytes) -> bytes | None:
        (entry,) = self.acquire_many([key])
        if entry is None:
            return None
        try:
            return bytes(self.view(entry))
        finally:
            self.release(entry)

    def put(self: _ZeroCopy, key: bytes, value: bytes | bytearray | memoryview) -> bool:
        data = memoryview(value).cast("B")
        slot = self.reserve(key, len(data))
        if slot is None:
            return False
        slot.view[:] = data
        return self.commit([slot])[0] is not None

    def delete(self: _ZeroCopy, key: bytes) -> bool:
        return self.delete_many([key])[0]

    def contains(self: _ZeroCopy, key: bytes) -> bool:
        return self.contains_many([key])[0]


class DramTier(_Copies):
    """Byte-bounded store over an :class:`Arena`, evicting by ``policy`` (a name from
    ``tiers/eviction.py``: ``chain``, or ``lru``)."""

    name = "dram"

    def __init__(self, capacity_bytes: int, *, default_ttl_s: float | None = None,
                 allocate_ahead_bytes: int = 0, clock: Clock = time.monotonic,
                 policy: str = "chain") -> None:
        self.arena = Arena(capacity_bytes, allocate_ahead=allocate_ahead_bytes)
        self._clock = clock
        self._default_ttl = default_ttl_s
        #: the entries, their bytes, and the eviction order (pinned entries held out of it)
        self.policy = policy
        self._ledger: Ledger[Entry] = Ledger(policy)
        self._entries = self._ledger.records  # (read here; changed through the ledger)
        self._deadlines: Deadlines[Entry] = Deadlines()  # TTLs
        self._stats = TierStats(self.name, self.arena.capacity)
        #: each entry dropped to make room or at its TTL (not deletes), reported with it
        self.events = TierEvents(self.name)
        #: each tenant's bytes (reserved or stored) and quota
        self.tenants = TenantBytes()
        #: entries by where they lie (for room by place, when LRU order makes none)
        self._places: Places[Entry] = Places(self.arena)
        self._room = self._new_room()
        #: where co-located clients look values up with no request (see attach_index)
        self.index: ArenaIndex | None = None
        #: arena bytes of the pinned entries: what no eviction can free
        self.pinned_extents = 0
        #: reads in progress (holds of entries not yet released)
        self._reading = 0

    # -- zero-copy data path --------------------------------------------------------------

    def reserve(self, key: bytes, nbytes: int, tenant: str | None = None) -> Slot | None:
        """Arena memory for an incoming value, evicting as needed; None if it can't fit.

        Least recently used entries go first, up to the value's own size; if no extent
        big enough has formed by then (small values scattered over the arena), room is
        made by place around one of the next victims (``tiers/room.py``): one value
        evicts at most about twice its size, not the whole cache (unless pinned or held
        entries or slots block every hole tried: then LRU order alone, if some run of the
        arena is wide enough; else refused there). A ``tenant`` with a quota first makes
        room among its own chunks (least recently used first): one tenant never evicts
        another to exceed its quota. A value bigger than what the pinned entries leave of
        the arena is refused before anything is evicted (it had emptied the tier of every
        unpinned entry, then failed).
        """
        arena = self.arena
        if arena.extent(nbytes) > arena.capacity - self.pinned_extents:
            # it would not fit with everything evictable gone: refused, nothing evicted
            self._stats.rejections += 1
            return None
        if tenant is not None and not self._room.within_quota(self.tenants, tenant, nbytes):
            self._stats.rejections += 1
            self.tenants.rejections += 1
            return None
        offset = self._room.make(nbytes)
        if offset is None:
            self._stats.rejections += 1
            return None
        self.tenants.charge(tenant, nbytes)
        return Slot(self, key, offset, nbytes, tenant)

    def commit(self, slots: Sequence[Slot], *, ttl_s: Sequence[float | None] | None = None,
               pin: Sequence[bool] | None = None,
               parents: Sequence[bytes | None] | None = None) -> list[Entry | None]:
        """Publish received slots under their keys; None for a slot that is not an envelope."""
        ok: list[Entry | None] = []
        touched: list[tuple[bytes, int]] = []
        for i, slot in enumerate(slots):
            try:
                header = EnvelopeHeader.unpack(slot.view)
                if header.value_len != slot.length:
                    raise CorruptChunkError("envelope length does not match the value")
            except CorruptChunkError:
                slot.release()
                ok.append(None)
                continue
            slot.committed = True
            slot.view.release()
            ttl = ttl_s[i] if ttl_s is not None else None
            depth = header.chunk_index
            entry = Entry(slot.key, slot.offset, slot.length, depth,
                          pinned=bool(pin[i]) if pin is not None else False,
                          parent=parents[i] if parents is not None else None,
                          num_tokens=header.num_tokens, tenant=slot.tenant,
                          checksum=header.checksum if header.codec is Codec.RAW else -1)
            self._insert(entry, ttl)
            if not entry.pinned:
                touched.append((entry.key, depth))
            ok.append(entry)
        for key in self._ledger.touch_many(touched):
            self._entries[key].reused = True
        return ok

    def attach_index(self, index: ArenaIndex) -> None:
        """Publish every value in ``index`` from now on (and those stored already)."""
        self.index = index
        for entry in self._entries.values():
            self._publish(entry)

    def acquire_many(self, keys: Sequence[bytes]) -> list[Entry | None]:
        """Live entries for ``keys`` (None = miss), held until :meth:`release`."""
        return self._read_many(keys, hold=True)

    def touch_many(self, keys: Sequence[bytes]) -> list[Entry | None]:
        """Count reads made without the node (through the arena index): hits, recency.

        Live entries for ``keys`` (None: gone meanwhile, counted as nothing), not held.
        """
        return self._read_many(keys, hold=False)

    def _read_many(self, keys: Sequence[bytes], *, hold: bool) -> list[Entry | None]:
        now = self._clock()
        wall = time.time()
        found: list[Entry | None] = []
        touched: list[tuple[bytes, int]] = []
        for key in keys:
            entry = self._live(key, now)
            if entry is None:
                self._stats.misses += 1
                found.append(None)
                continue
            self._stats.hits += 1
            if hold:
                entry.readers += 1
                self._reading += 1
            entry.last_access = wall
            entry.reused = True
            found.append(entry)
            if not entry.pinned:
                touched.append((key, entry.depth))
        self._ledger.touch_many(touched)
        return found

    def hold(self, entry: Entry) -> None:
        """Keep ``entry``'s memory alive (not a read: no stats, no recency) until release."""
        entry.readers += 1
        self._reading += 1

    def view(self, entry: Entry) -> memoryview:
        return self.arena.view[entry.offset : entry.offset + entry.length]

    def release(self, entry: Entry) -> None:
        entry.readers -= 1
        self._reading -= 1
        if entry.readers == 0 and not entry.live:
            self.arena.free(entry.offset, entry.length)

    # -- key operations -------------------------------------------------------------------

    def keys(self) -> list[bytes]:
        """A snapshot of the keys held now (live or not yet swept)."""
        return list(self._entries)

    def peek(self, key: bytes) -> Entry | None:
        """The live entry for ``key``, without counting a hit or touching its recency."""
        return self._live(key, self._clock())

    def ttl_left(self, entry: Entry) -> float | None:
        """Seconds until ``entry`` expires (None: no TTL)."""
        if entry.expires_at is None:
            return None
        return max(0.0, entry.expires_at - self._clock())

    def evict_where(self, keep: Callable[[Entry], bool] | None = None) -> list[Entry]:
        """Evict every unpinned entry not being read that ``keep`` does not keep; the evicted."""
        gone = [e for e in list(self._entries.values())
                if not e.pinned and e.readers == 0 and (keep is None or not keep(e))]
        for entry in gone:
            self._remove(entry)
            self._stats.evictions += 1
        return gone

    def contains_many(self, keys: Sequence[bytes], *, interest: bool = False) -> list[bool]:
        """Whether each key is held. ``interest``: a client looked them up, which the
        eviction policy may count as a use of those found (no hit counted, no recency)."""
        now = self._clock()
        if self._deadlines.next_at > now:  # no entry has expired: a look-up in C a key
            found = list(map(self._entries.__contains__, keys))
        else:
            found = [self._live(key, now) is not None for key in keys]
        if interest:
            self._interest([key for key, held in zip(keys, found, strict=True) if held])
        return found

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are present (a lookup: ``interest`` in those)."""
        now = self._clock()
        for i, key in enumerate(keys):
            if self._live(key, now) is None:
                self._interest(keys[:i])
                return i
        self._interest(keys)
        return len(keys)

    def _interest(self, held: Sequence[bytes]) -> None:
        """``held`` keys were looked up: a use to the policy, and reuse."""
        self._ledger.notice(held)
        entries = self._entries
        for key in held:
            entries[key].reused = True

    def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        out = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                self._remove(entry)
            out.append(entry is not None)
        return out

    def pin_many(self, keys: Sequence[bytes], pinned: bool) -> list[bool]:
        """Pin (never evict) or unpin; idempotent. False for a missing key."""
        now = self._clock()
        out = []
        touched: list[tuple[bytes, int]] = []
        for key in keys:
            entry = self._live(key, now)
            if entry is None:
                out.append(False)
                continue
            if pinned and not entry.pinned:
                entry.pinned = True
                self.pinned_extents += Arena.extent(entry.length)
                self._ledger.hold_out(key)
            elif not pinned and entry.pinned:
                entry.pinned = False
                self.pinned_extents -= Arena.extent(entry.length)
                touched.append((key, entry.depth))
            out.append(True)
        self._ledger.touch_many(touched)
        return out

    def expire(self) -> int:
        """Drop every entry whose TTL has passed; returns how many."""
        n = 0
        for expires_at, entry in self._deadlines.due(self._clock()):
            if entry.live and entry.expires_at == expires_at:  # else: stored again, or gone
                self._expired(entry)
                n += 1
        return n

    # -- the Tier interface: get / put / delete / contains from _Copies; stats ----------

    def stats(self) -> TierStats:
        s = self._stats
        s.num_objects = len(self._ledger)
        s.num_pinned = s.num_objects - self._ledger.evictable
        s.used_bytes = self._ledger.used
        s.allocated_bytes = self.arena.allocated_bytes
        return TierStats(**s.to_dict())

    def close(self) -> None:
        self._ledger = Ledger()
        self._entries = self._ledger.records
        self.pinned_extents = 0
        self._room = self._new_room()
        if self.index is not None:
            self.index.close()
            self.index = None
        self.arena.close()

    # -- internals ------------------------------------------------------------------------

    def _new_room(self) -> Room[Entry]:
        """Room for values in the arena, by this tier's ledger as it stands."""
        return Room(self.arena, self._ledger, self._places, evict=self._evict,
                    blocked=self._blocked, hand_over=self._hand_over)

    def _live(self, key: bytes, now: float) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at is not None and entry.expires_at <= now:
            self._expired(entry)
            return None
        return entry

    def _blocked(self) -> bool:
        """Whether anything no eviction moves lies in the arena: pinned entries, entries
        being read, slots being written (or entries gone, not yet released by readers)."""
        return bool(self.pinned_extents or self._reading
                    or self.arena.allocated_bytes > self._places.extents)

    def _expired(self, entry: Entry) -> None:
        self._remove(entry)
        self._stats.expirations += 1
        self.events.dropped(entry.key, "ttl", entry)

    def _insert(self, entry: Entry, ttl_s: float | None) -> None:
        old = self._entries.get(entry.key)
        if old is not None:
            entry.pinned = entry.pinned or old.pinned
            self._remove(old)
        ttl = ttl_s if ttl_s is not None else self._default_ttl
        if ttl is not None:
            entry.expires_at = self._clock() + ttl
            self._deadlines.add(entry.expires_at, entry)
        entry.last_access = time.time()
        self._ledger.add(entry.key, entry, used_now=False)  # the caller touches (unpinned)
        self._places.add(entry)
        if entry.pinned:
            self.pinned_extents += Arena.extent(entry.length)
        self._stats.insertions += 1
        if self.index is not None:
            self._publish(entry)

    def _publish(self, entry: Entry) -> None:
        assert self.index is not None
        if entry.checksum >= 0:  # clients read the index's values as raw payloads
            self.index.publish(_index_slot(entry, self.arena, self._clock()))

    def _remove(self, entry: Entry, *, evicted: bool = False, keep_extent: bool = False
                ) -> None:
        if self.index is not None:  # before the extent is freed
            self.index.withdraw(entry.key)
        self._ledger.forget(entry.key, evicted=evicted)
        self._places.discard(entry)
        if entry.pinned:
            self.pinned_extents -= Arena.extent(entry.length)
        self.tenants.charge(entry.tenant, -entry.length)
        entry.live = False
        if keep_extent:  # (not being read: the caller's new value takes the extent)
            self.arena.reuse(entry.offset)
        elif entry.readers == 0:
            self.arena.free(entry.offset, entry.length)

    def _evict(self, entry: Entry, *, keep_extent: bool = False) -> None:
        self._remove(entry, evicted=True, keep_extent=keep_extent)
        self._stats.evictions += 1
        self.events.dropped(entry.key, "room", entry)

    def _hand_over(self, entry: Entry) -> None:
        """Evict ``entry`` (not being read) for a new value of its extent, which takes its
        memory as it lies (no free, no allocation)."""
        self._evict(entry, keep_extent=True)
