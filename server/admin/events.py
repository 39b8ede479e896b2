"""KV events for cache-aware request routers: what a node stored, evicted or demoted.

Events are published only while someone listens (``GET /v1/events``, as
server-sent events), so a node with no subscribers pays one attribute test per
batch. An event goes into one log of the last ``queue_size`` events that every
subscriber reads from at its own cursor (it is serialized once, when first read):
publishing costs the same for 1 subscriber or 100, subscribers are woken at
most every :data:`FLUSH_S` (50 ms: an event may wait that long), and a
subscriber that does not read costs nothing while it does not (the admin API
keeps its socket's send buffer small, so it stops being written to soon). One
that falls ``queue_size`` events behind (it stopped reading) is dropped: its
stream is closed, the event it missed is counted in the node's stats. A
listener that reconnects starts from the events after it. A subscription whose
token a reload revoked is dropped the same way (:meth:`EventBus.recheck`).
(Before the log, each subscriber had a queue of its own, and 100 that never
read cut another client's PUT rate to 0.16x.)

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
import itertools
import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["EVENT_TYPES", "Event", "EventBus", "Subscription"]

EVENT_TYPES = ("stored", "evicted", "demoted", "removed", "expired")
log = logging.getLogger("kvpool.server")
#: publishes between two sweeps for subscribers that fell out of the log
SWEEP_EVERY = 256
#: subscribers are woken at most this often (events in between go out as one write):
#: 100 listening streams then cost a few wake-ups a second, not 100 per PUT batch
FLUSH_S = 0.05


def _always(_table: object) -> bool:
    return True


class Event(NamedTuple):
    kind: str
    data: dict[str, Any]
    #: the event as one server-sent event (made once, sent to every subscriber)
    line: bytes


class _Entry:
    """One published event, made into an :class:`Event` (and serialized) only when a
    subscriber first takes it: a listener that stopped reading costs no JSON."""

    __slots__ = ("depth", "event", "key", "kind", "parent", "tier")

    def __init__(self, kind: str, key: bytes, tier: str, parent: bytes | None,
                 depth: int | None) -> None:
        self.kind, self.key, self.tier, self.parent, self.depth = kind, key, tier, parent, depth
        self.event: Event | None = None

    def made(self, node_id: str) -> Event:
        if self.event is None:
            data = {"type": self.kind, "key": self.key.hex(),
                    "parent": self.parent.hex() if self.parent else None, "tier": self.tier,
                    "node": node_id, "depth": self.depth}
            self.event = Event(self.kind, data, f"event: {self.kind}\ndata: "
                                                f"{json.dumps(data)}\n\n".encode())
        return self.event


@dataclass(eq=False)
class Subscription:
    types: frozenset[str]
    #: the sequence number of the next event this subscriber reads
    cursor: int
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
        self._log: deque[_Entry] = deque(maxlen=queue_size)
        #: the sequence number of the next event published
        self._head = 0
        #: resolved at the next flush after a publish (or at a drop); awaited by every
        #: idle subscriber
        self._waiter: asyncio.Future[None] | None = None
        self._flush: asyncio.TimerHandle | None = None

    def subscribe(self, types: frozenset[str] = frozenset(EVENT_TYPES), *,
                  keep: Callable[[Any], bool] = _always,
                  on_close: Callable[[], None] | None = None) -> Subscription:
        """A subscription to the events published from now on."""
        sub = Subscription(types, self._head, keep=keep, on_close=on_close)
        self.subscribers.append(sub)
        return sub

    def take(self, sub: Subscription, most: int | None = None) -> list[Event]:
        """The events of ``sub``'s types published since its last take, of at most
        ``most`` published (none once it was dropped; dropped now if it fell out of the
        log)."""
        if sub.closed:
            return []
        behind = self._head - sub.cursor
        if behind > len(self._log):
            self._drop_behind(sub)
            return []
        recent = list(itertools.islice(reversed(self._log), behind))[::-1][:most]
        sub.cursor += len(recent)
        return [e.made(self.node_id) for e in recent if e.kind in sub.types]

    async def wait(self, sub: Subscription, most: int | None = None) -> list[Event]:
        """:meth:`take`, after waiting for the next event if there is none yet (or for
        ``sub`` to be dropped: then ``sub.closed``). Cancelling the wait (a timeout)
        leaves the other subscribers waiting."""
        if sub.cursor == self._head and not sub.closed:
            if self._waiter is None or self._waiter.done():
                self._waiter = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._waiter)
        return self.take(sub, most)

    def _wake(self) -> None:
        self._flush = None
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        self._waiter = None

    def _wake_soon(self) -> None:
        """Wake the subscribers within :data:`FLUSH_S` (at once outside an event loop)."""
        if self._flush is not None or self._waiter is None:
            return  # a flush is due, or nobody waits (a take will find the events)
        try:
            self._flush = asyncio.get_running_loop().call_later(FLUSH_S, self._wake)
        except RuntimeError:
            self._wake()

    def drop(self, sub: Subscription) -> None:
        """End ``sub``: its stream finishes and its connection is closed."""
        sub.closed = True
        self.unsubscribe(sub)
        self._wake()
        if sub.on_close is not None:
            sub.on_close()

    def _drop_behind(self, sub: Subscription) -> None:
        self.lost += 1
        self.dropped += 1
        log.info("an event subscriber fell %d events behind: dropped", self.queue_size)
        self.drop(sub)

    def recheck(self, table: object) -> int:
        """After a tokens reload: drop the subscribers whose token no longer allows them
        (``table``, the new tokens table); how many were dropped."""
        gone = [sub for sub in self.subscribers if not sub.keep(table)]
        for sub in gone:
            self.drop(sub)
        return len(gone)

    def close(self) -> None:
        """End every subscription (node shutdown): their streams finish."""
        if self._flush is not None:
            self._flush.cancel()
        for sub in self.subscribers:
            sub.closed = True
        self.subscribers = []
        self._log.clear()
        self._wake()

    def unsubscribe(self, sub: Subscription) -> None:
        if sub in self.subscribers:
            self.subscribers.remove(sub)
        if not self.subscribers:
            self._log.clear()  # nobody reads it: the memory back

    def publish(self, kind: str, key: bytes, *, tier: str, parent: bytes | None = None,
                depth: int | None = None) -> None:
        """Add one event to the log (never blocks; the same cost for any number of
        subscribers)."""
        if not self.subscribers:
            return
        self._log.append(_Entry(kind, key, tier, parent, depth))
        self._head += 1
        self.published += 1
        self._wake_soon()
        if self._head % SWEEP_EVERY == 0:  # drop those that stopped reading
            for sub in [s for s in self.subscribers
                        if self._head - s.cursor > self.queue_size]:
                self._drop_behind(sub)
