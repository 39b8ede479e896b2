"""The op table's same-host fast-path ops: GET_SHM, RELEASE, TOUCH, PUT_SHM, COMMIT,
COMMIT_AS.

They answer with where values lie in the shared arena instead of the values, under
leases of the connection's session (``server/data/shm.py`` keeps the leases and grants);
a GET_SHM reads, and a COMMIT stores, through the op table's own GET and PUT paths,
so the tiers see one kind of read and one kind of write.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.protocol.errors import BadFrameError, Status
from kvpool.protocol.frames import (
    COMMIT_AGAIN,
    Op,
    ShmItem,
    decode_commit_as,
    decode_lease_ids,
    encode_lease_ids,
    encode_statuses,
)
from kvpool.protocol.parsers import PutItem, Request, release_items
from kvpool.server.data.reply import Buffers, Pending, Reply
from kvpool.server.data.session import Session
from kvpool.server.data.shm import ShmService
from kvpool.server.data.stats import NodeStats
from kvpool.tiers.arena import ALIGN
from kvpool.tiers.dram import DramTier, Entry, Slot

__all__ = ["ShmOps"]


class ShmOps:
    """The fast path's ops over ``service``. ``read(request, session)``: the op table's
    GET, leasing what it finds to ``session`` (it answers through :meth:`lease_reply`);
    ``store(request, items, tail)``: its PUT of received slots (the reply's statuses,
    then ``tail``); ``reply(request, body)``: a reply frame."""

    def __init__(self, service: ShmService, dram: DramTier, stats: NodeStats, *,
                 read: Callable[[Request, Session], Reply | Pending],
                 store: Callable[[Request, Sequence[PutItem], Buffers | None], Reply | Pending],
                 reply: Callable[[Request, Buffers], Reply],
                 reused: Callable[[list[Entry | None]], None] = lambda entries: None) -> None:
        self.service = service
        self._reused = reused
        self.dram = dram
        self.stats = stats
        self._read = read
        self._store = store
        self._reply = reply
        self.table: dict[int, Callable[[Request, Session], Reply | Pending]] = {
            Op.GET_SHM: self.get_shm,
            Op.RELEASE: self.release,
            Op.PUT_SHM: self.put_shm,
            Op.COMMIT: self.commit,
            Op.COMMIT_AS: self.commit_as,
            Op.TOUCH: self.touch,
        }

    def get_shm(self, request: Request, session: Session) -> Reply | Pending:
        if not session.shm:
            raise BadFrameError("GET_SHM needs a connection granted the shared-memory arena")
        return self._read(request, session)

    def release(self, request: Request, session: Session) -> Reply:
        ids = decode_lease_ids(request.body, request.header.count)
        done = self.service.release(session, ids)
        return self._reply(request, [encode_statuses(
            [Status.OK if d else Status.NOT_FOUND for d in done])])

    def touch(self, request: Request, session: Session) -> Reply:
        """Values a client read through the arena index: count them, as GET_SHM would."""
        if not session.shm:
            raise BadFrameError("TOUCH needs a connection granted the shared-memory arena")
        entries = self.dram.touch_many(request.keys)
        self._reused(entries)
        found = [e for e in entries if e is not None]
        # hits: the reported keys the node still holds (a client's TOUCH of keys the node
        # never had counts nothing), as the index counters below count them
        counters = self.service.counters
        self.stats.hits += len(found)
        counters.index_bytes_out += sum(e.length for e in found)
        counters.index_items_out += len(found)
        self.stats.tokens_served += sum(e.num_tokens for e in found)
        return self._reply(request, [encode_statuses(
            [Status.NOT_FOUND if e is None else Status.OK for e in entries])])

    def put_shm(self, request: Request, session: Session) -> Reply:
        """Reserve a slot per item for the client to write into; they wait for COMMIT."""
        if not session.write:
            raise BadFrameError("PUT_SHM needs a connection granted the arena for writing")
        return self._reply(request, self._reserve(request, request.items, session))

    def _reserve(self, request: Request, items: list[PutItem], session: Session) -> Buffers:
        """A slot for each of ``items`` (``request``'s or their like), under one lease of
        ``session``: the lease id, then where each slot lies (NO_CAPACITY: no room)."""
        tenant = session.principal.quota_tenant
        keys = request.keys or [item.header.key for item in request.items]  # scoped, if any
        body: Buffers = []
        reserved = 0
        for key, item in zip(keys, items, strict=True):
            slot = self.dram.reserve(key, item.header.value_len, tenant)
            item.reservation = slot
            if slot is None:
                body.append(ShmItem(Status.NO_CAPACITY, 0, 0, 0).pack())
            else:
                body.append(ShmItem(Status.OK, slot.offset, slot.length, 0).pack())
                reserved += 1
        lease = self.service.reserve(session, items) if reserved else 0
        return [encode_lease_ids([lease]), *body]

    def commit(self, request: Request, session: Session) -> Reply | Pending:
        """Publish the slots of a PUT_SHM lease (NOT_FOUND for all: it had expired)."""
        if not session.write:
            raise BadFrameError("COMMIT needs a connection granted the arena for writing")
        (lease,) = decode_lease_ids(request.body, 1)
        items = self.service.take(session, lease)
        count = request.header.count
        if items is None:
            self.stats.error(Status.NOT_FOUND, Op.COMMIT)
            return self._reply(request, [encode_statuses([Status.NOT_FOUND] * count)])
        if len(items) != count:
            release_items(items)
            raise BadFrameError(f"COMMIT of {count} items for a lease of {len(items)}")
        self._count_commit(items)
        return self._store(request, items, None)

    def commit_as(self, request: Request, session: Session) -> Reply | Pending:
        """COMMIT under the keys (and TTLs, flags, parents) of the frame's item headers, of
        the sizes the lease's slots were reserved for; with COMMIT_AGAIN, slots of the same
        sizes under a new lease follow the statuses (the client's next put of this shape
        writes into them: one round trip a put)."""
        if not session.write:
            raise BadFrameError("COMMIT_AS needs a connection granted the arena for writing")
        lease, flags = decode_commit_as(request.body)
        held = self.service.take(session, lease)
        count = request.header.count
        if held is not None and (len(held) != count or any(
                h.header.value_len != i.header.value_len
                for h, i in zip(held, request.items, strict=True))):
            release_items(held)
            raise BadFrameError("COMMIT_AS items do not match the sizes of the lease's slots")
        tail: Buffers | None = None
        if flags & COMMIT_AGAIN:
            tail = self._reserve(request, [PutItem(i.header, None) for i in request.items],
                                 session)
        if held is None:
            self.stats.error(Status.NOT_FOUND, Op.COMMIT_AS)
            return self._reply(request, [encode_statuses([Status.NOT_FOUND] * count),
                                         *(tail or ())])
        keys = request.keys or [item.header.key for item in request.items]  # scoped, if any
        tenant = session.principal.quota_tenant
        items: list[PutItem] = []
        for key, old, new in zip(keys, held, request.items, strict=True):
            if isinstance(old.reservation, Slot):  # PUT_SHM reserved it: always a Slot
                old.reservation.assign(key, tenant)
            items.append(PutItem(new.header, old.reservation, new.parent))
        self._count_commit(items)
        return self._store(request, items, tail)

    def abandon(self, request: Request, session: Session) -> None:
        """A COMMIT_AS refused whole (WRONG_OWNER: the client puts again, routed by a newer
        map): its lease's slots go back now, not when the lease ends."""
        lease, _ = decode_commit_as(request.body)
        self.service.release(session, [lease])

    def _count_commit(self, items: list[PutItem]) -> None:
        reserved = [i for i in items if i.reservation is not None]
        self.service.counters.committed += len(reserved)
        self.service.counters.bytes_in += sum(i.header.value_len for i in reserved)

    def lease_reply(self, request: Request, entries: list[Entry | None], session: Session
                    ) -> Reply:
        """GET_SHM's answer: where each value lies in the arena; the entries stay held
        under one lease of ``session``."""
        gens = self.dram.arena.gens
        items: Buffers = []
        found: list[Entry] = []
        num_bytes = tokens = 0
        miss = ShmItem(Status.NOT_FOUND, 0, 0, 0).pack()
        for entry in entries:
            if entry is None:
                items.append(miss)
                continue
            items.append(ShmItem(Status.OK, entry.offset, entry.length,
                                 gens[entry.offset // ALIGN]).pack())
            found.append(entry)
            num_bytes += entry.length
            tokens += entry.num_tokens
        lease = self.service.lease(session, found) if found else 0
        self.service.counters.bytes_out += num_bytes
        self.service.counters.items_out += len(found)
        self.stats.tokens_served += tokens
        return self._reply(request, [encode_lease_ids([lease]), *items])
