"""What a node's tiers tell the outside: the events its subscribers hear (``/v1/events``:
stored, removed, evicted, demoted, expired) and what one chunk's record says."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.server.admin.events import EventBus
from kvpool.server.cold.base import ColdTier
from kvpool.tiers.dram import DramTier, Entry
from kvpool.tiers.events import Why

__all__ = ["TierReports", "chunk_info"]


class TierReports:
    """The events of one node's tiers on ``bus``: those the tier manager publishes as it
    stores and deletes, and those the tiers report by themselves (it listens on their
    sinks, :mod:`kvpool.tiers.events`). Nothing is built while nobody subscribes."""

    def __init__(self, dram: DramTier, cold: ColdTier, bus: EventBus) -> None:
        self.dram, self.cold, self.bus = dram, cold, bus
        dram.events.listen(self)
        cold.events.listen(self)

    def stored(self, entries: Sequence[Entry | None]) -> None:
        """Chunks committed to DRAM (a PUT's, or promoted from below)."""
        if self.bus.subscribers:
            for entry in entries:
                if entry is not None:
                    self.bus.publish("stored", entry.key, tier="dram", parent=entry.parent,
                                     depth=entry.depth)

    def removed(self, keys: Sequence[bytes], tiers: Sequence[str]) -> None:
        """Keys deleted, each with the highest tier that held it ("": none did)."""
        if self.bus.subscribers:
            for key, tier in zip(keys, tiers, strict=True):
                if tier:
                    self.bus.publish("removed", key, tier=tier)

    def evicted(self, entries: Sequence[Entry]) -> None:
        """Chunks DRAM was asked to let go of (the admin API's evict)."""
        if self.bus.subscribers:
            for entry in entries:
                self._evicted(entry)

    def dropped(self, tier: str, key: bytes, why: Why, entry: object) -> None:
        """A tier let ``key`` go by itself: the event that means for subscribers."""
        if not self.bus.subscribers:
            return
        if tier != self.dram.name:
            self._cold_evicted(key)
        elif isinstance(entry, Entry):
            (self._expired if why == "ttl" else self._evicted)(entry)

    def _evicted(self, entry: Entry) -> None:
        """DRAM made room by dropping ``entry``: an evicted or demoted event."""
        ssd = self.cold
        lower = None
        if ssd.up:
            lower = "ssd" if entry.key in ssd.index else "s3" if entry.key in ssd.s3_index \
                else None
        self.bus.publish("demoted" if lower else "evicted", entry.key,
                         tier=lower or "dram", parent=entry.parent, depth=entry.depth)

    def _expired(self, entry: Entry) -> None:
        """DRAM dropped ``entry`` at the end of its TTL (a chunk with a TTL is DRAM-only)."""
        self.bus.publish("expired", entry.key, tier="dram", parent=entry.parent,
                         depth=entry.depth)

    def _cold_evicted(self, key: bytes) -> None:
        """The SSD dropped ``key`` to make room: an evicted or demoted event, unless DRAM
        still holds it (then this node's view of the chunk has not changed)."""
        if self.dram.contains(key):
            return
        in_s3 = key in self.cold.s3_index
        self.bus.publish("demoted" if in_s3 else "evicted", key,
                         tier="s3" if in_s3 else "ssd")


def chunk_info(dram: DramTier, cold: ColdTier, key: bytes) -> dict[str, Any] | None:
    """What a node knows of one chunk, without reading it (None: no tier has it)."""
    entry = dram.peek(key)
    on_ssd = cold.up and key in cold.index
    in_s3 = cold.up and key in cold.s3_index
    tiers = [name for name, held in (("dram", entry is not None), ("ssd", on_ssd),
                                     ("s3", in_s3)) if held]
    if not tiers:
        return None
    info: dict[str, Any] = {"key": key.hex(), "tiers": tiers, "pinned": False,
                            "ttl_s": None, "last_access": None, "depth": None,
                            "num_tokens": None, "parent": None, "size_bytes": None}
    if entry is not None:
        info.update(size_bytes=entry.length, pinned=entry.pinned,
                    ttl_s=dram.ttl_left(entry), last_access=entry.last_access,
                    depth=entry.depth, num_tokens=entry.num_tokens,
                    parent=entry.parent.hex() if entry.parent else None)
    elif on_ssd:
        info["size_bytes"] = cold.index[key]
    return info
