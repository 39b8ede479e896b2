"""A cold tier in this process's memory, for the tier manager's tests: no worker
process, no files (``tests/server/test_tiering.py`` runs the same tests on the real worker).

It keeps what the SSD worker's handle promises (``kvpool.server.cold.base.ColdTier``):
writes complete on a later turn of the loop, as a worker's reply does, and copy the
value out of the arena only then (the manager holds the memory meanwhile); a DELETE
overtakes the writes of its key queued before it; reads copy into the arena.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from kvpool.protocol.worker import SsdStatus
from kvpool.server.cold.base import ColdCounters, KeySet, QueuedWrites
from kvpool.tiers.events import TierEvents
from kvpool.tiers.tenants import TenantBytes


class MemoryColdTier:
    """An SSD (a dict, at most ``capacity`` bytes, oldest evicted first) and, with
    ``s3``, an S3 below it (a dict; every durable write lands there)."""

    def __init__(self, arena: memoryview, *, ssd: bool = True, s3: bool = False,
                 capacity: int = 1 << 40) -> None:
        self.arena = arena
        self.has_ssd, self.has_s3, self.capacity = ssd, s3, capacity
        self.up = True
        self.counters = ColdCounters()
        self.tenants = TenantBytes()
        self.events = TierEvents("ssd")
        self._ssd: dict[bytes, bytes] = {}
        self._index: dict[bytes, int] = {}
        self.s3: dict[bytes, bytes] = {}
        self._writing = QueuedWrites()
        self._fetched: dict[bytes, bytes] = {}

    @property
    def index(self) -> Mapping[bytes, int]:
        return self._index

    @property
    def s3_index(self) -> KeySet:
        return self.s3.keys()

    def holds(self, key: bytes) -> bool:
        return key in self._index or key in self.s3 or key in self._writing

    def write(self, key: bytes, offset: int, length: int, on_done: Callable[[bool], object],
              *, durable: bool = False, tenant: str | None = None) -> bool:
        if not self.up:
            self.counters.shed += 1
            return False
        self.counters.pending_writes += 1
        self.counters.pending_write_bytes += length
        self._writing.queue(key)
        asyncio.get_running_loop().call_soon(
            self._written, key, offset, length, on_done, durable or not self.has_ssd)
        return True

    def _written(self, key: bytes, offset: int, length: int,
                 on_done: Callable[[bool], object], durable: bool) -> None:
        c = self.counters
        c.pending_writes -= 1
        c.pending_write_bytes -= length
        if not self._writing.done(key):
            value = bytes(self.arena[offset : offset + length])
            if self.has_ssd:
                self._ssd[key], self._index[key] = value, length
                while sum(self._index.values()) > self.capacity:
                    self.evict(next(iter(self._index)))
                    c.evicted += 1
            if durable and self.has_s3:
                self.s3[key] = value
        c.writes += 1
        c.write_bytes += length
        on_done(True)

    async def read_into(self, key: bytes, offset: int, length: int) -> int:
        value = self._ssd.get(key)
        if value is None:
            self.counters.read_misses += 1
            return int(SsdStatus.MISS)
        if len(value) != length:
            return int(SsdStatus.SIZE)
        self.arena[offset : offset + length] = value
        self.counters.reads += 1
        self.counters.read_bytes += length
        return int(SsdStatus.OK)

    async def fetch(self, key: bytes) -> int | None:
        value = self.s3.get(key)
        if value is None:
            return None
        self._fetched[key] = value
        return len(value)

    async def copy(self, key: bytes, offset: int, length: int) -> bool:
        value = self._fetched.pop(key, None)
        if value is None or len(value) != length:
            return False
        self.arena[offset : offset + length] = value
        return True

    async def confirm(self, key: bytes) -> bool:
        return self.up and key in self.s3

    def evict(self, key: bytes) -> None:
        self._ssd.pop(key, None)
        self._index.pop(key, None)
        self.events.dropped(key, "room")

    def delete(self, key: bytes) -> None:
        self._ssd.pop(key, None)
        self._index.pop(key, None)
        self.s3.pop(key, None)
        self._writing.overtake(key)

    async def describe(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        if self.has_ssd:
            out["ssd"] = {"name": "ssd", "up": self.up, "num_objects": len(self._index),
                          "raw_bytes": sum(self._index.values()), **asdict(self.counters)}
        if self.has_s3:
            out["s3"] = {"name": "s3", "keys_known": len(self.s3)}
        return out

    async def stop(self) -> None:
        self.up = False
