"""KV events for cache-aware request routers: what a node stored, evicted or demoted.

Events are published only while someone listens (``GET /v1/events``, as
server-sent events), so a node with no subscribers pays one attribute test
per batch. Each subscriber has a bounded queue (``queue_size`` events); a
subscriber that falls that far behind (one that stopped reading) is dropped:
its stream is closed, the event it missed is counted in the node's stats, and
it costs the data path nothing more. A listener that reconnects starts from
the events after it. A subscription whose token a reload revoked is dropped
the same way (:meth:`EventBus.recheck`).

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
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EVENT_TYPES", "EventBus", "Subscription"]

EVENT_TYPES = ("stored", "evicted", "demoted", "removed", "expired")
log = logging.getLogger("kvpool.server")


def _always(_table: object) -> bool:
    return True


@dataclass
class Subscription:
    queue: asyncio.Queue[dict[str, Any]]
    types: frozenset[str]
    closed: bool = False
    #: given the node's tokens table after a reload: whether the subscriber may go on
    keep: Callable[[Any], bool] = field(default=_always)
    #: ends the subscriber's stream (its connection) when it is dropped
    on_close: Callable[[], None] | None = None


class EventBus:
    def __init__(self, node_id: str = "", queue_size: int = 10_000) -> None:
        self.node_id = node_id
        self.queue_size = queue_size
        self.subscribers: list[Subscription] = []
        self.published = 0
        #: events a subscriber did not get: it was dropped, that many behind
        self.lost = 0
        #: subscribers dropped for falling ``queue_size`` events behind
        self.dropped = 0

    def subscribe(self, types: frozenset[str] = frozenset(EVENT_TYPES), *,
                  keep: Callable[[Any], bool] = _always,
                  on_close: Callable[[], None] | None = None) -> Subscription:
        sub = Subscription(asyncio.Queue(self.queue_size), types, keep=keep, on_close=on_close)
        self.subscribers.append(sub)
        return sub

    def drop(self, sub: Subscription) -> None:
        """End ``sub``: its stream finishes and its connection is closed."""
        sub.closed = True
        self.unsubscribe(sub)
        with contextlib.suppress(asyncio.QueueFull):
            sub.queue.put_nowait({"type": "closed"})
        if sub.on_close is not None:
            sub.on_close()

    def recheck(self, table: object) -> int:
        """After a tokens reload: drop the subscribers whose token no longer allows them
        (``table``, the new tokens table); how many were dropped."""
        gone = [sub for sub in self.subscribers if not sub.keep(table)]
        for sub in gone:
            self.drop(sub)
        return len(gone)

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
        behind: list[Subscription] = []
        for sub in self.subscribers:
            if kind not in sub.types:
                continue
            if sub.queue.full():  # stopped reading, or far behind: dropped, never waited for
                behind.append(sub)
                continue
            sub.queue.put_nowait(event)
        for sub in behind:
            self.lost += 1
            self.dropped += 1
            log.info("an event subscriber fell %d events behind: dropped", self.queue_size)
            self.drop(sub)
