"""Same-host puts: values written straight into slots of the node's arena.

A put through the arena takes two round trips the first time: PUT_SHM reserves a
slot per value (under a lease), the client writes each envelope and payload into
its slot, and COMMIT publishes them. A node that takes COMMIT_AS (its HELLO offer
says ``commit_as``) is sent that instead of COMMIT: the same publish, under the
item headers the frame carries, and with COMMIT_AGAIN it reserves as many slots of
the same sizes under a new lease in the same reply. The connection keeps those
(:class:`Ahead`; several, for puts in flight together), and the next put of that shape
(the usual case: an engine's chunks all have one size) writes into them and sends only
COMMIT_AS, with its own keys: one round trip a put instead of two.

Slots held ahead are arena memory reserved for a put that may not come: the node
gives them back when the lease ends (``lease_s``, 5 s by default, or the connection
closes), and this client sends RELEASE for those it will not use (once a put of
another shape comes, or past the bounds below). It uses them only within half the
lease: a lease that ran out under a client writing into its slots could have them
reused by another value (readers then find that value corrupt and drop it; never
wrong bytes), so the margin is kept wide.

The put is a plan (:meth:`LeasedPuts.plan`, ``kvpool.client._plans``): the loop runs it
on a pooled connection, the sync client on its blocking link, which says HELLO with its
own arena grant (``kvpool.client._blocking``), so a sync put through the arena runs no
event loop (1 MiB: 0.48 -> 0.32 ms p50, ``bench.client_ab --puts``). Each connection
holds its own slots ahead, under its own session's leases. Slots a put gives up go
back in its first round; those the reply reserved past the bounds go back at once on
the loop, and with the next put on a blocking link (one request at a time: no frame is
sent whose reply nobody reads), or when the link or the lease ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from kvpool.client import _plans as plans
from kvpool.client._checks import reply_statuses
from kvpool.client._connection import Buffer, Connection
from kvpool.client._options import ClientOptions
from kvpool.client._shm import Ahead, ShmMapping
from kvpool.protocol.errors import Status
from kvpool.protocol.frames import (
    COMMIT_AGAIN,
    Op,
    ShmItem,
    decode_shm_reply,
    encode_commit_as,
    encode_lease_ids,
)
from kvpool.protocol.parsers import Reply, Segments

__all__ = ["AHEAD_MAX_BYTES", "AHEAD_MAX_LEASES", "AheadHolder", "ArenaHost", "LeasedPuts",
           "ignore_result"]

T = TypeVar("T")

#: a connection holds slots ahead for at most this many bytes (and 1/16 of the arena) in
#: all, in at most AHEAD_MAX_LEASES leases (puts in flight together each take one): they
#: are memory taken from the cache until the next put
AHEAD_MAX_BYTES = 64 << 20
AHEAD_MAX_LEASES = 8


def _max_held(shm: ShmMapping) -> int:
    """The most bytes of slots one connection holds ahead."""
    return min(AHEAD_MAX_BYTES, shm.capacity // 16)


def ignore_result(future: asyncio.Future[Any]) -> None:
    """A RELEASE or TOUCH reply: nothing to do (a failed connection ends its leases)."""
    if not future.cancelled():
        future.exception()


class AheadHolder(Protocol):
    """A connection that can hold slots ahead: the loop's ``Connection``, or the sync
    client's blocking driver for the link it owns (their leases are its session's)."""

    #: slots the node reserved for this connection's next puts of the same sizes
    put_ahead: list[Ahead]
    #: slots held ahead it gave up: given back at once on the loop, with the next request
    #: on a blocking link (which cannot send a frame whose reply nobody reads)
    put_unwanted: list[Ahead]
    #: the node granted it the arena for writing (PUT_SHM, COMMIT)
    shm_write: bool

    @property
    def is_open(self) -> bool: ...


class ArenaHost(plans.Host, Protocol):
    """What the arena path reads and drives of the node client it belongs to (a
    ``kvpool.client._node.NodeClient``; named here so the two modules do not import
    each other)."""

    options: ClientOptions
    #: the map epoch its requests carry (0: none)
    epoch: int

    def connections(self) -> list[Connection]: ...

    async def run(self, plan: plans.Plan[T], conn: Connection | None = None) -> T: ...

    async def gather(self, calls: Sequence[tuple[Connection, int, int, Sequence[Buffer],
                                                  Sequence[memoryview | Segments | None]
                                                  | None]]) -> list[Reply]: ...


class LeasedPuts:
    """The arena put of one node client (:meth:`plan`, and :meth:`put` on the loop), and
    the slots each of its connections holds ahead."""

    def __init__(self, node: ArenaHost) -> None:
        self.node = node
        #: PUT_SHM leases that ended before their COMMIT (the values went again over TCP)
        self.expired = 0
        #: puts that wrote into slots held ahead (one round trip), and those that did not
        self.one_trip = 0
        self.two_trips = 0

    def release_unwanted(self, conn: Connection) -> None:
        """Give back now (without waiting for the replies) the slots ``conn`` gave up."""
        for ahead in conn.put_unwanted:
            self._release(conn, ahead)
        conn.put_unwanted = []

    def plan(self, holder: AheadHolder, shm: ShmMapping, items: list[plans.PutItem],
             statuses: list[int], *, num_tokens: int, fingerprint: bytes
             ) -> plans.Plan[list[plans.PutItem]]:
        """Write ``items`` into arena slots and publish them, on the connection ``holder``
        (its driver runs the plan there); fills ``statuses`` and returns the items whose
        lease ended before their COMMIT (to go over TCP). Slots held ahead that this put
        gives up go back (RELEASE) in its first round."""
        frames = plans.frames(self.node, items)
        heads = [[b for it in frame for b in it.head()] for frame in frames]
        # the sizes of a put of one frame: what slots held ahead must match
        shape = tuple(it.header.value_len for it in frames[0]) if len(frames) == 1 else None
        ahead = self._take_ahead(holder, shape)
        releases: list[plans.Call] = [(Op.RELEASE, 1, [encode_lease_ids([a.lease])], None)
                                      for a in holder.put_unwanted]
        holder.put_unwanted = []
        leases: list[tuple[int, list[ShmItem]]]
        if ahead is not None:
            leases = [(ahead.lease, ahead.slots)]
            self.one_trip += 1
        else:
            replies = yield [*releases, *[(Op.PUT_SHM, len(frame), head, None)
                                          for frame, head in zip(frames, heads, strict=True)]]
            leases = [decode_shm_reply(reply.body, len(frame))
                      for frame, reply in zip(frames, replies[len(releases):], strict=True)]
            releases = []
            self.two_trips += 1
        may_hold = shm.commit_as and shape is not None and sum(shape) <= _max_held(shm)
        flags = COMMIT_AGAIN if may_hold else 0
        commits: list[plans.Call] = []
        committing: list[list[plans.PutItem]] = []
        writes: list[tuple[ShmItem, Sequence[memoryview], int]] = []
        for frame, head, (lease, slots) in zip(frames, heads, leases, strict=True):
            for item, slot in zip(frame, slots, strict=True):
                if slot.status == Status.OK:
                    writes.append((slot, item.parts, item.chunk_index))
                else:
                    statuses[item.index] = slot.status
            if not lease:
                continue
            if shm.commit_as:
                commits.append((Op.COMMIT_AS, len(frame),
                                [encode_commit_as(lease, flags), *head], None))
            else:
                commits.append((Op.COMMIT, len(frame), [encode_lease_ids([lease])], None))
            committing.append(frame)
        shm.write_many(writes, num_tokens=num_tokens, fingerprint=fingerprint)
        expired: list[plans.PutItem] = []
        if not releases and not commits:
            return expired
        replies = yield [*releases, *commits]
        for frame, reply in zip(committing, replies[len(releases):], strict=True):
            count = len(frame)
            body = memoryview(reply.body)
            if shape is not None and flags:
                self._keep_ahead(holder, shm, body[count:], shape)
            answers = reply_statuses(self.node.node_id, body[:count], count)
            for item, status in zip(frame, answers, strict=True):
                if status == Status.NOT_FOUND:  # the lease ended before COMMIT: not stored
                    expired.append(item)
                    continue
                statuses[item.index] = status
                if status == Status.OK:
                    self.node.put_bytes_by_path["shm"] += item.nbytes
        self.expired += len(expired)
        return expired

    def _take_ahead(self, holder: AheadHolder, shape: tuple[int, ...] | None) -> Ahead | None:
        """Slots ``holder`` holds ahead that fit this put (one frame of the sizes ``shape``,
        in time; None: a put of several frames); they are this put's now. Those of another
        shape (the puts changed), or past half their lease, are to be given back
        (``put_unwanted``)."""
        held = holder.put_ahead
        if not held:
            return None
        now = time.monotonic()
        found = None
        keep: list[Ahead] = []
        for ahead in held:
            if ahead.lengths != shape or now >= ahead.usable_until:
                holder.put_unwanted.append(ahead)
            elif found is None:
                found = ahead
            else:
                keep.append(ahead)
        holder.put_ahead = keep
        return found

    def _keep_ahead(self, holder: AheadHolder, shm: ShmMapping, tail: memoryview,
                    shape: tuple[int, ...]) -> None:
        """Keep the slots a COMMIT_AGAIN reply reserved for a put of the sizes ``shape``
        (all of them, or none), within the connection's bounds."""
        lease, slots = decode_shm_reply(tail, len(shape))
        if not lease:
            return
        ahead = Ahead(lease, slots, shape, time.monotonic() + shm.lease_s / 2)
        held = holder.put_ahead
        nbytes = sum(ahead.lengths) + sum(sum(a.lengths) for a in held)
        if any(slot.status != Status.OK for slot in slots) or not holder.is_open \
                or len(held) >= AHEAD_MAX_LEASES or nbytes > _max_held(shm):
            holder.put_unwanted.append(ahead)
            return
        held.append(ahead)

    def _release(self, conn: Connection, ahead: Ahead) -> None:
        """Give the slots back now, without waiting for the reply."""
        if conn.is_open:
            conn.send(Op.RELEASE, 1, [encode_lease_ids([ahead.lease])],
                      epoch=self.node.epoch).add_done_callback(ignore_result)
