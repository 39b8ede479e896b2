"""What lies below a node's DRAM, as its tier manager uses it: :class:`ColdTier`.

The manager (``tiering.py``) is built over one, given at construction: the SSD worker's
handle (``ssd.py``: RocksDB, S3 below it, or S3 alone), :class:`NoColdTier` for a
DRAM-only node, or an in-memory one in tests. Everything the data path asks without
I/O (is the key below? how long is it?) is an attribute or a plain call; reads,
fetches from S3 and confirmations are awaited; writes are queued with a callback, and
a tier that cannot take one says so at once (a cache sheds work rather than block).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvpool.protocol.worker import SsdStatus
from kvpool.tiers.events import TierEvents
from kvpool.tiers.tenants import TenantBytes

__all__ = ["ColdCounters", "ColdTier", "KeySet", "NoColdTier", "QueuedWrites"]


@dataclass(slots=True)
class ColdCounters:
    """What a cold tier counts (the stats' ``tiers.ssd`` / ``tiers.s3.node``, metrics)."""

    writes: int = 0
    write_bytes: int = 0
    refused: int = 0
    shed: int = 0
    reads: int = 0
    read_bytes: int = 0
    read_misses: int = 0
    corrupt: int = 0
    errors: int = 0
    evicted: int = 0
    pending_writes: int = 0
    pending_write_bytes: int = 0
    #: times the tier took writes again after a full disk
    recovered: int = 0
    #: chunks not written below at their PUT: no reuse shown yet (``--ssd-admit reused``;
    #: written later if one is read or looked up while in DRAM)
    held_back: int = 0


class QueuedWrites:
    """The writes of each key queued to a cold tier and not yet done, and the rule a
    ``delete`` keeps: the writes of its key queued before it complete first (a tier
    serves them in order) and must not be indexed as held."""

    def __init__(self) -> None:
        self._queued: dict[bytes, int] = {}
        self._overtaken: dict[bytes, int] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._queued

    def queue(self, key: bytes) -> None:
        self._queued[key] = self._queued.get(key, 0) + 1

    def overtake(self, key: bytes) -> None:
        """A delete of ``key``: every write of it queued so far is overtaken."""
        if key in self._queued:
            self._overtaken[key] = self._queued[key]

    def done(self, key: bytes) -> bool:
        """A write of ``key`` completed; whether a delete overtook it (then the key is not
        held, whatever the write's outcome)."""
        self._queued[key] -= 1
        if not self._queued[key]:
            del self._queued[key]
        overtaken = self._overtaken.pop(key, 0)
        if overtaken > 1:
            self._overtaken[key] = overtaken - 1
        return overtaken > 0


class KeySet(Protocol):
    def __contains__(self, key: bytes) -> bool: ...


class ColdTier(Protocol):
    """The tiers below DRAM: an SSD (``has_ssd``), S3 (``has_s3``), both, or neither.

    Values move between the DRAM arena and the tier by offset and length in the arena
    (the SSD worker maps the same memory). Keys are content addresses: a key below holds
    the same bytes as the key in DRAM.
    """

    counters: ColdCounters
    #: the SSD bytes of each tenant with a quota, and the quotas (set by the node)
    tenants: TenantBytes
    #: where the tier reports each key it dropped to make room (the tier manager listens)
    events: TierEvents

    @property
    def index(self) -> Mapping[bytes, int]:
        """Chunks on the SSD, each with its stored (RAW envelope) length: a DRAM slot of
        that size is reserved before a promotion."""
        ...

    @property
    def s3_index(self) -> KeySet:
        """Keys S3 is known to hold (its writes and its LISTs; lags another node's
        DELETE until the next LIST)."""
        ...

    @property
    def up(self) -> bool:
        """Whether it serves now (a worker that died leaves DRAM serving alone)."""
        ...

    @property
    def has_ssd(self) -> bool: ...

    @property
    def has_s3(self) -> bool: ...

    def holds(self, key: bytes) -> bool:
        """Whether the SSD or S3 has ``key``, or a write of it is queued."""
        ...

    def write(self, key: bytes, offset: int, length: int, on_done: Callable[[bool], object],
              *, durable: bool = False, tenant: str | None = None) -> bool:
        """Queue a write of arena[offset:offset+length] under ``key``; False (a shed write,
        counted) if it cannot take it now. Otherwise the caller keeps that memory alive
        until ``on_done(stored)``. ``durable``: ``stored`` means S3 has it."""
        ...

    async def read_into(self, key: bytes, offset: int, length: int) -> int:
        """Read ``key`` from the SSD into arena[offset:offset+length]; an SsdStatus."""
        ...

    async def fetch(self, key: bytes) -> int | None:
        """Fetch ``key`` from S3, checked; its stored length, or None (not there)."""
        ...

    async def copy(self, key: bytes, offset: int, length: int) -> bool:
        """Copy the value :meth:`fetch` fetched into arena[offset:offset+length]."""
        ...

    async def confirm(self, key: bytes) -> bool:
        """Whether S3 has ``key``, asked of S3 itself rather than of :attr:`s3_index`."""
        ...

    def evict(self, key: bytes) -> None:
        """Drop ``key`` from the SSD only (S3 keeps its copy)."""
        ...

    def delete(self, key: bytes) -> None:
        """Drop ``key`` from the SSD and S3 (nobody waits); queued writes of it are not
        indexed when they complete."""
        ...

    async def describe(self) -> dict[str, dict[str, Any]]:
        """Its part of the stats snapshot's ``tiers``: ``{"ssd": ..., "s3": ...}``, each
        where the tier has it."""
        ...

    async def stop(self) -> None: ...


class NoColdTier:
    """Nothing below DRAM: holds nothing, takes no write (and counts none as shed: there
    is no tier to shed it from), never up."""

    def __init__(self) -> None:
        self.index: Mapping[bytes, int] = {}
        self.s3_index: KeySet = frozenset()
        self.counters = ColdCounters()
        self.tenants = TenantBytes()
        self.events = TierEvents("cold")

    up = False
    has_ssd = False
    has_s3 = False

    def holds(self, key: bytes) -> bool:
        return False

    def write(self, key: bytes, offset: int, length: int, on_done: Callable[[bool], object],
              *, durable: bool = False, tenant: str | None = None) -> bool:
        return False

    async def read_into(self, key: bytes, offset: int, length: int) -> int:
        return int(SsdStatus.MISS)

    async def fetch(self, key: bytes) -> int | None:
        return None

    async def copy(self, key: bytes, offset: int, length: int) -> bool:
        return False

    async def confirm(self, key: bytes) -> bool:
        return False

    def evict(self, key: bytes) -> None:
        pass

    def delete(self, key: bytes) -> None:
        pass

    async def describe(self) -> dict[str, dict[str, Any]]:
        return {}

    async def stop(self) -> None:
        pass
