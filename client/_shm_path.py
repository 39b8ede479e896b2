"""The same-host fast path to one node: values through its shared-memory arena.

:class:`ShmPath` belongs to one :class:`kvpool.client._node.NodeClient` and
holds what the node granted at HELLO (the arena mapping, maybe its index and
write access). GETs copy what the arena index has with no request, then ask
GET_SHM (a lease) for the rest, and fall back to TCP for values freed while
they were copied; puts write into slots PUT_SHM (or the put before) reserved,
COMMIT them (``client/_shm_put.py``), and send over TCP what a lease lost.
Reads through the index are reported to the node later in one TOUCH
(``client/_touches.py``).

It owns its TCP fallback, and so the choice of path: every GET and put of its
node client comes here (:meth:`ShmPath.get`, :meth:`ShmPath.put`), and goes over
TCP, by the same op plans, when the arena cannot carry it (none granted, ``shm=False``,
a connection not granted, a put below ``shm_put_min_bytes``). The sync client asks
the same questions before its loop-free paths (:attr:`ShmPath.carries_gets`,
:meth:`ShmPath.carries_put`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from kvpool.client import _plans as plans
from kvpool.client._connection import Connection
from kvpool.client._plans import routed_by
from kvpool.client._shm import HASH_SOURCE, TORN, ShmIndex, ShmMapping
from kvpool.client._shm_grant import ArenaGrant
from kvpool.client._shm_put import AheadHolder, ArenaHost, LeasedPuts, ignore_result
from kvpool.client._touches import TOUCH_BATCH, TOUCH_DELAY_S, Touches
from kvpool.client.paths import BlockingGets
from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE
from kvpool.protocol.errors import Status
from kvpool.protocol.frames import (
    KEY_SIZE,
    Op,
    ShmItem,
    decode_shm_reply,
    encode_lease_ids,
)
from kvpool.protocol.parsers import TOO_SMALL, Segments

__all__ = ["TOUCH_BATCH", "TOUCH_DELAY_S", "ShmPath"]


class ShmPath(ArenaGrant):
    """One node's arena, as this client mapped it, and the ops that go through it (the
    first :class:`kvpool.client.paths.NodePath`)."""

    def __init__(self, node: ArenaHost) -> None:
        super().__init__(node)
        #: puts through the arena (PUT_SHM, or slots held ahead; COMMIT or COMMIT_AS)
        self.puts = LeasedPuts(node)
        #: fast-path values freed while they were copied (fetched again over TCP)
        self.shm_torn = 0
        #: values read through the index; found there but stale (asked again: GET_SHM, or
        #: over TCP from the sync client's thread)
        self.index_hits = 0
        self.index_stale = 0
        #: reads through the index not yet reported (TOUCH)
        self.touches = Touches(node, self._conn)

    def close(self) -> None:
        """Stop the TOUCH timer (reads still to report are sent first, when a loop runs)."""
        self.touches.close()

    # -- the data path --------------------------------------------------------------------

    @property
    def shm_put_expired(self) -> int:
        """PUT_SHM leases that ended before their COMMIT (the values went again over TCP)."""
        return self.puts.expired

    @property
    def carries_gets(self) -> bool:
        """Whether GETs go through the arena (else over TCP): the node granted it."""
        return self.mapping is not None and self.node.options.shm is not False

    def carries_put(self, items: Sequence[plans.PutItem]) -> bool:
        """Whether a put of ``items`` goes through the arena (else over TCP): the node
        granted this client writes, and the values total ``shm_put_min_bytes`` or more."""
        shm, options = self.mapping, self.node.options
        return shm is not None and shm.writable and options.shm is not False \
            and sum(it.nbytes for it in items) >= options.shm_put_min_bytes

    async def put(self, conn: Connection, items: list[plans.PutItem], *, num_tokens: int,
                  fingerprint: bytes) -> list[int]:
        """One Status per item: through the arena where it carries the put and ``conn`` may
        write it, else over TCP (:meth:`put_plan` on ``conn``)."""
        try:
            return await self.node.run(self.put_plan(conn, items, num_tokens=num_tokens,
                                                     fingerprint=fingerprint), conn)
        finally:
            self.puts.release_unwanted(conn)

    def put_plan(self, holder: AheadHolder, items: list[plans.PutItem], *,
                 num_tokens: int, fingerprint: bytes) -> plans.Plan[list[int]]:
        """One Status per item: through the arena where it carries the put and ``holder``,
        the connection the plan runs on, was granted writes (PUT_SHM, the values into their
        slots, COMMIT; see ``client/_shm_put.py``), else over TCP; an item whose lease
        ended before its COMMIT goes again over TCP."""
        statuses = [0] * len(items)
        by_tcp = items
        if holder.shm_write and self.carries_put(items):
            assert self.mapping is not None
            by_tcp = yield from self.puts.plan(holder, self.mapping, items, statuses,
                                               num_tokens=num_tokens, fingerprint=fingerprint)
        if by_tcp:
            yield from plans.put_tcp(self.node, by_tcp, statuses, num_tokens=num_tokens,
                                     fingerprint=fingerprint)
        return statuses

    async def get(self, conn: Connection, blob: bytes,
                  sinks: Sequence[memoryview | Segments] | None
                  ) -> list[memoryview | Segments | None]:
        """Payload views (None for misses and corrupt chunks). Through the arena where it
        carries GETs: values the arena index has are copied with no request (and
        reported later, in one TOUCH for many calls); the rest are asked for with
        GET_SHM. Else over TCP."""
        shm = self.mapping
        if shm is None or not conn.shm or self.node.options.shm is False:
            return await self.node.run(plans.get_tcp(self.node, blob, sinks), conn)
        if not self.node.options.shm_index or shm.index is None:
            return await self._get_leased(conn, shm, blob, sinks)
        found = self._read_indexed(shm, blob, sinks, all_or_none=False)
        if found is None:  # an index of another map: GET_SHM answers WRONG_OWNER, or the map
            return await self._get_leased(conn, shm, blob, sinks)
        out, rest = found
        self.touches.later(conn)
        if rest:
            again = await self._get_leased(conn, shm, plans.rows_blob(blob, rest),
                                           [sinks[i] for i in rest] if sinks is not None
                                           else None)
            for i, payload in zip(rest, again, strict=True):
                out[i] = payload
        return out

    def get_here(self, blob: bytes, sinks: Sequence[memoryview | Segments] | None,
                 link: BlockingGets | None, before_read: Callable[[], bool]
                 ) -> list[memoryview | Segments | None] | None:
        """A GET in the caller's thread with no event loop (the sync client's): what the
        arena index has, then the rest (misses, values the index had no room for) in one
        round trip over TCP on ``link`` (GET_SHM runs on the loop: a thread hop each way
        and a lease to release, 2-3x slower below ~256 KiB); where the node's GETs go
        over TCP, all on ``link``. None, having sent nothing: run it on the loop (no
        ``link`` and a key the index lacks, or GETs through the arena whose index this
        client cannot read: GET_SHM)."""
        if self.mapping is not None:  # the node granted its arena
            if self.can_read_local:
                # all from the index, or else (no link) all on the loop; once the loop ran
                # (it may have heard the node go), only if the index may still be read
                found = self._read_indexed(self.mapping, blob, sinks, all_or_none=link is None) \
                    if not before_read() or self.can_read_local else None
                if found is not None:
                    out, rest = found
                    if rest:
                        assert link is not None
                        again = link.get(plans.rows_blob(blob, rest),
                                         [sinks[i] for i in rest] if sinks is not None
                                         else None)
                        for row, view in zip(rest, again, strict=True):
                            out[row] = view
                    return out
            if self.carries_gets:
                return None
        return link.get(blob, sinks) if link is not None else None

    @property
    def can_read_local(self) -> bool:
        """Whether the arena index may be read with no request now (a mapped index, a
        connection granted the arena that is, as far as this thread has seen, open)."""
        shm = self.mapping
        return shm is not None and shm.index is not None and self.node.options.shm_index \
            and self.node.options.shm is not False and self._conn() is not None

    def _conn(self) -> Connection | None:
        """An open connection granted the arena (as far as this thread has seen)."""
        return next((conn for conn in self.node.connections() if conn.shm), None)

    def _of_this_map(self, index: ShmIndex) -> bool:
        """Whether ``index`` is of the map this call is routed by (else the node answers
        WRONG_OWNER, or with the map: ask it)."""
        return index.epoch == (routed_by.get() or self.node.epoch)

    def _read_indexed(self, shm: ShmMapping, blob: bytes,
                      sinks: Sequence[memoryview | Segments] | None, *, all_or_none: bool
                      ) -> tuple[list[memoryview | Segments | None], list[int]] | None:
        """Copy what the arena index has: ``(payloads, rows not read)``, the reads noted
        for the next TOUCH. None, having copied nothing, where the index is of another
        map, or (``all_or_none``) unless every key is there (then copies that came out
        stale give None too: nothing is noted)."""
        index = shm.index
        assert index is not None
        if not self._of_this_map(index):
            return None
        count = len(blob) // KEY_SIZE
        out: list[memoryview | Segments | None] = [None] * count
        rows: list[int] = []
        jobs: list[tuple[ShmItem, memoryview | Segments | None]] = []
        checksums: list[int] = []
        for i in range(count):
            slot = index.find(blob[i * KEY_SIZE : (i + 1) * KEY_SIZE])
            if slot is None:
                if all_or_none:
                    return None
                continue
            rows.append(i)
            jobs.append((ShmItem(Status.OK, slot.offset, slot.length, slot.generation),
                         sinks[i] if sinks is not None else None))
            checksums.append(slot.checksum)
        hits: list[int] = []
        nbytes = 0
        for i, (item, _), (status, payload) in zip(rows, jobs, shm.read_many(jobs, checksums),
                                                   strict=True):
            if status == Status.OK:
                out[i] = payload
                hits.append(i)
                nbytes += item.length - ENVELOPE_HEADER_SIZE
            else:  # freed, rewritten, or too small a buffer: GET_SHM says for sure
                self.index_stale += 1
        if all_or_none and len(hits) < count:
            return None
        if hits:
            self._note_hits(blob if len(hits) == count else plans.rows_blob(blob, hits),
                            len(hits), nbytes)
        if len(hits) == count:
            return out, []
        hit = set(hits)
        return out, [i for i in range(count) if i not in hit]

    def _note_hits(self, keys: bytes, count: int, nbytes: int) -> None:
        """Values read through the index, for the next TOUCH and the counters."""
        self.index_hits += count
        self.node.bytes_by_path["shm"] += nbytes
        self.touches.note(keys, count)

    def consume_local(self, key: bytes, fn: Callable[[memoryview], None]) -> bool:
        """Hand ``fn`` the value of ``key`` where it lies in the arena, found through the
        index (:meth:`ShmMapping.consume`); False (``fn`` not called, or called on bytes
        of no value) where that is not so. Only where :attr:`can_read_local`, and on
        x86-64 (HASH_SOURCE)."""
        shm = self.mapping
        assert shm is not None and shm.index is not None
        if not HASH_SOURCE or not self._of_this_map(shm.index):
            return False
        slot = shm.index.find(key)
        if slot is None:
            return False
        item = ShmItem(Status.OK, slot.offset, slot.length, slot.generation)
        if shm.consume(item, slot.checksum, fn) != Status.OK:
            self.index_stale += 1
            return False
        self._note_hits(key, 1, slot.length - ENVELOPE_HEADER_SIZE)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the sync client's: its next call on the loop reports it
            return True
        self.touches.later()
        return True

    async def _get_leased(self, conn: Connection, shm: ShmMapping, blob: bytes,
                          sinks: Sequence[memoryview | Segments] | None
                          ) -> list[memoryview | Segments | None]:
        """GET_SHM: copy each value from the mapping, then release the lease."""
        max_batch = int(self.node.server_info["max_batch"])
        parts = plans.chunks(len(blob) // KEY_SIZE, max_batch)
        replies = await self.node.gather(
            [(conn, Op.GET_SHM, len(p), [plans.blob_part(blob, p)], None) for p in parts])
        corrupt: list[bytes] = []
        torn: list[int] = []
        leases: list[int] = []
        too_small = -1
        found: list[tuple[int, ShmItem]] = []
        for part, reply in zip(parts, replies, strict=True):
            lease, items = decode_shm_reply(reply.body, len(part))
            if lease:
                leases.append(lease)
            found += [(i, item) for i, item in zip(part, items, strict=True)
                      if item.status == Status.OK]
        out: list[memoryview | Segments | None] = [None] * (len(blob) // KEY_SIZE)
        results = shm.read_many([(item, sinks[i] if sinks is not None else None)
                                 for i, item in found])
        for (i, item), (status, payload) in zip(found, results, strict=True):
            out[i] = payload
            if status == Status.OK:
                self.node.bytes_by_path["shm"] += item.length - ENVELOPE_HEADER_SIZE
            elif status == TORN:
                torn.append(i)
            elif status == TOO_SMALL and too_small < 0:
                too_small = i
            elif status == Status.CORRUPT:
                corrupt.append(plans.blob_part(blob, range(i, i + 1)))
        if leases:  # copied: the node may evict those values again (no need to wait)
            release = conn.send(Op.RELEASE, len(leases), [encode_lease_ids(leases)],
                                epoch=self.node.epoch)
            release.add_done_callback(ignore_result)
        if too_small >= 0:
            plans.too_small(blob, too_small, sinks)
        if torn:  # freed (and maybe reused) mid-copy: ask again over TCP
            self.shm_torn += len(torn)
            again = await self.node.run(plans.get_tcp(
                self.node, plans.rows_blob(blob, torn),
                [sinks[i] for i in torn] if sinks is not None else None), conn)
            for i, payload in zip(torn, again, strict=True):
                out[i] = payload
        await self.node.run(plans.drop_corrupt(self.node, corrupt), conn)
        return out
