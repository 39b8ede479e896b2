"""KV events for cache-aware request routers: what a node stored, evicted or demoted.

Events are published only while someone listens (``GET /v1/events``, as
server-sent events), so a node with no subscribers pays one attribute test
per batch. Each subscriber has a bounded queue; a subscriber that falls
behind loses events, and the number lost is reported to it in a ``lost``
event and counted in the node's stats, never blocking the data path.

An event is ``{"type", "key", "parent", "tier", "node", "depth"}``:

- ``stored``: a chunk was stored in ``tier`` ("dram" on PUT or promotion);
- ``evicted``: a chunk left DRAM (``tier`` "dram") or the SSD ("ssd") to make
  room and no lower tier of this node holds it (it is gone from this node);
- ``demoted``: a chunk left DRAM and is still on this node's SSD or in S3, or
  left the SSD and is still in S3 (``tier`` says where it is now). A chunk that
  leaves the SSD while DRAM holds it makes no event;
- ``removed``: a chunk was deleted (DELETE) from this node (``tier``: the
  highest tier that held it);
- ``expired``: a chunk's TTL passed (chunks with a TTL live in DRAM only, so
  it is gone from this node).

``parent`` is the key of the previous chunk of the prefix when the writer
sent it (``put_many(parents=...)``), else null; keys are 32 hex characters.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

__all__ = ["EVENT_TYPES", "EventBus", "Subscription"]

EVENT_TYPES = ("stored", "evicted", "demoted", "removed", "expired")


@dataclass
class Subscription:
    queue: asyncio.Queue[dict[str, Any]]
    types: frozenset[str]
    lost: int = 0
    closed: bool = False


class EventBus:
    def __init__(self, node_id: str = "", queue_size: int = 10_000) -> None:
        self.node_id = node_id
        self.queue_size = queue_size
        self.subscribers: list[Subscription] = []
        self.published = 0
        self.lost = 0

    def subscribe(self, types: frozenset[str] = frozenset(EVENT_TYPES)) -> Subscription:
        sub = Subscription(asyncio.Queue(self.queue_size), types)
        self.subscribers.append(sub)
        return sub

    def close(self) -> None:
        """End every subscription (node shutdown): their streams finish."""
        for sub in self.subscribers:
            sub.closed = True
            with contextlib.suppress(asyncio.QueueFull):
                sub.queue.put_nowait({"type": "closed"})
        self.subscribers = []

    def unsubscribe(self, sub: Subscription) -> None:
        if sub in self.subscribers:
            self.subscribers.remove(sub)

    def publish(self, kind: str, key: bytes, *, tier: str, parent: bytes | None = None,
                depth: int | None = None) -> None:
        """Queue one event for every subscriber that wants its type (never blocks)."""
        if not self.subscribers:
            return
        event = {"type": kind, "key": key.hex(), "parent": parent.hex() if parent else None,
                 "tier": tier, "node": self.node_id, "depth": depth}
        self.published += 1
        for sub in self.subscribers:
            if kind not in sub.types:
                continue
            try:
                sub.queue.put_nowait(event)
            except asyncio.QueueFull:
                sub.lost += 1
                self.lost += 1
