"""What each opcode does on a node, over the DRAM tier and (if enabled) the SSD tier.

A handler returns the reply as a list of buffers (values are arena
memoryviews, never copied) plus the DRAM entries that must stay acquired
until those buffers have been written out. A GET that must promote chunks
from SSD returns a coroutine instead; the connection awaits it and writes
the reply when it is ready (replies carry request ids, so order is free).

Tiering: every chunk committed to DRAM is queued for a write-behind to SSD
(skipped if the SSD already has that key: keys are content addresses), so
that evicting it from DRAM later is a plain drop. Chunks with a TTL stay in
DRAM only (the SSD tier keeps no expiry yet). A GET that misses DRAM but
hits the SSD index reserves a DRAM slot, has the SSD worker fill it (and
verify the checksum), commits it and serves it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Tracer

from kvpool.protocol.envelope import CODEC_NAMES
from kvpool.protocol.errors import (
    AuthenticationError,
    BadFrameError,
    Status,
    VersionMismatchError,
)
from kvpool.protocol.frames import (
    PROTOCOL_VERSION,
    PUT_FLAG_PIN,
    Op,
    ShmItem,
    Tier,
    decode_json,
    decode_lease_ids,
    encode_error,
    encode_frame,
    encode_json,
    encode_lease_ids,
    encode_lookup_reply,
    encode_statuses,
    pack_get_item,
)
from kvpool.protocol.parsers import Limits, PutItem, Request
from kvpool.server.auth import ANONYMOUS, Role, TokenTable
from kvpool.server.events import EventBus
from kvpool.server.membership import Membership
from kvpool.server.session import Session
from kvpool.server.shm import ShmService
from kvpool.server.ssd import SsdTier, SsdUnavailableError
from kvpool.server.ssd_messages import SsdStatus
from kvpool.server.stats import NodeStats
from kvpool.server.tracing import NodeTracing, tier_span
from kvpool.tiers.arena import ALIGN
from kvpool.tiers.dram import DramTier, Entry, Slot

__all__ = ["Handlers", "Pending", "Reply"]

Buffers = list[bytes | bytearray | memoryview]
_STATUS_OF_TIER = bytes([Status.NOT_FOUND] + [Status.OK] * 255)
#: ops whose keys are placed by the cluster map (a stale client may have sent them astray)
_ROUTED_OPS = frozenset({Op.PUT, Op.GET, Op.EXISTS, Op.DELETE, Op.LOOKUP, Op.PIN, Op.UNPIN,
                         Op.GET_SHM, Op.PUT_SHM})
_PUT_OPS = frozenset({Op.PUT, Op.PUT_SHM})
Pending = Coroutine[Any, Any, "Reply"]


@dataclass(slots=True)
class Reply:
    buffers: Buffers
    held: list[Entry] = field(default_factory=list)
    num_bytes: int = 0


class Handlers:
    """Dispatch table from opcode to handler, shared by every connection of a node."""

    def __init__(self, node_id: str, dram: DramTier, limits: Limits, stats: NodeStats,
                 membership: Membership | None = None) -> None:
        self.node_id = node_id
        self.membership = membership or Membership()
        #: where the node listens, for the map a standalone node serves (set by the Node)
        self.addresses: tuple[tuple[str, int], tuple[str, int]] = (("", 0), ("", 0))
        self.wrong_owner = 0
        #: more sections of the stats snapshot (name -> function giving a JSON-able value)
        self.extra_stats: dict[str, Callable[[], Any]] = {}
        self.dram = dram
        self.events = EventBus(node_id)
        dram.on_evict = self._evicted
        dram.on_expire = self._expired
        self.limits = limits
        self.stats = stats
        self.ssd: SsdTier | None = None
        #: the same-host fast path (None: off)
        self.shm: ShmService | None = None
        #: spans for requests that carry a trace context (None: tracing is not configured)
        self.tracing: NodeTracing | None = None
        #: the node closes data connections idle this long (0: never); told in HELLO
        self.idle_timeout_s = 0.0
        #: tokens -> tenant and role (empty: open mode); replaced whole on SIGHUP
        self.auth = TokenTable()
        self.auth_failures = 0
        #: acknowledge PUTs only once S3 has them (needs an SSD tier with S3)
        self.write_through = False
        self.promotions = 0
        self.started_at = time.time()
        self._table: dict[int, Callable[[Request], Reply | Pending]] = {
            Op.PUT: self.put,
            Op.GET: self.get,
            Op.EXISTS: self.exists,
            Op.DELETE: self.delete,
            Op.LOOKUP: self.lookup,
            Op.PIN: self.pin,
            Op.UNPIN: self.unpin,
            Op.STATS: self.node_stats,
            Op.CLUSTER: self.cluster,
        }
        #: the ops that act on the connection's session (auth, the shared-memory fast path)
        self._session_table: dict[int, Callable[[Request, Session], Reply | Pending]] = {
            Op.HELLO: self.hello,
            Op.GET_SHM: self.get_shm,
            Op.RELEASE: self.release,
            Op.PUT_SHM: self.put_shm,
            Op.COMMIT: self.commit,
            Op.TOUCH: self.touch,
        }

    @property
    def epoch(self) -> int:
        return self.membership.epoch

    def _tracer(self, request: Request) -> Tracer | None:
        """The tracer for ``request``'s tier spans; None (no spans) for an untraced one."""
        return self.tracing.tracer if request.trace is not None and self.tracing else None

    def _span_tracer(self) -> Tracer | None:
        """The tracer where a request span may be current (off the request's frame)."""
        return self.tracing.tracer if self.tracing is not None else None

    def handle(self, request: Request, session: Session) -> Reply | Pending:
        """Run one request of the connection whose state is ``session``."""
        header = request.header
        self.stats.count(header.op, header.count)
        if header.epoch < self.membership.epoch and header.op in _ROUTED_OPS:
            keys = [i.header.key for i in request.items] if header.op in _PUT_OPS else \
                request.client_keys if request.client_keys is not None else request.keys
            if not self.membership.accepts(keys):
                return self._wrong_owner(request)
        op = self._session_table.get(header.op)
        return op(request, session) if op is not None else self._table[header.op](request)

    def _wrong_owner(self, request: Request) -> Reply:
        """Refuse the whole frame (nothing is done); the client refreshes its map."""
        request.release()  # PUT values already received into DRAM slots
        self.wrong_owner += 1
        header = request.header
        self.stats.error(Status.WRONG_OWNER, header.op)
        message = (f"node {self.node_id} does not own every key under cluster map epoch "
                   f"{self.epoch} (request epoch {header.epoch})")
        body: Buffers = [*encode_error(header.op, header.request_id, Status.WRONG_OWNER, message,
                                       epoch=self.epoch)]
        return Reply(body)

    def cluster(self, request: Request) -> Reply:
        if request.body:
            raise BadFrameError("CLUSTER takes no body")
        data, admin = self.addresses
        return self._reply(request, [encode_json(self.membership.to_dict(data, admin))])

    # -- ops ------------------------------------------------------------------------------

    def hello(self, request: Request, session: Session) -> Reply:
        body = decode_json(request.body)
        version = body.get("protocol")
        if version != PROTOCOL_VERSION:
            raise VersionMismatchError(
                f"node speaks kvpool protocol {PROTOCOL_VERSION}, client sent {version!r}")
        principal = ANONYMOUS
        if not self.auth.open:
            token = body.get("token")
            found = self.auth.authenticate(token)
            if found is None:
                self.auth_failures += 1
                raise AuthenticationError(
                    "this node requires a token: give AsyncClient(token=...) or set "
                    "KVPOOL_TOKEN" if not token else "unknown token")
            principal = found
            session.token_digest = self.auth.digest(token)
        session.principal = principal
        session.any_uid = principal.tenant is None or principal.role == Role.ADMIN
        info = {
            "protocol": PROTOCOL_VERSION,
            "node_id": self.node_id,
            "max_value_bytes": self.limits.max_value_bytes,
            "max_batch": self.limits.max_batch,
            "max_frame_bytes": self.limits.max_frame_bytes,
            "epoch": self.epoch,
            "cluster": self.membership.map is not None,
            "idle_timeout_s": self.idle_timeout_s,
            "tenant": principal.tenant,
            "role": principal.role.name.lower(),
        }
        if self.shm is not None:
            offer = self.shm.offer(session, body)
            if offer is not None:
                info["shm"] = offer
        return self._reply(request, [encode_json(info)])

    def put(self, request: Request) -> Reply | Pending:
        return self._store(request, request.items)

    def _store(self, request: Request, items: Sequence[PutItem]) -> Reply | Pending:
        """Publish received slots (a PUT's, or a committed PUT_SHM's); reply one Status each."""
        statuses = [Status.OK] * len(items)
        slots: list[Slot] = []
        where: list[int] = []
        ttls: list[float | None] = []
        pins: list[bool] = []
        parents: list[bytes | None] = []
        for i, item in enumerate(items):
            if item.reservation is None:
                statuses[i] = Status.NO_CAPACITY
                continue
            assert isinstance(item.reservation, Slot)
            slots.append(item.reservation)
            where.append(i)
            ttls.append(item.header.ttl_ms / 1000 if item.header.ttl_ms else None)
            pins.append(bool(item.header.flags & PUT_FLAG_PIN))
            parents.append(item.parent)
            self.stats.bytes_in += item.header.value_len
        committed = self.dram.commit(slots, ttl_s=ttls, pin=pins, parents=parents)
        for i, entry in zip(where, committed, strict=True):
            if entry is None:
                statuses[i] = Status.CORRUPT
            elif self.events.subscribers:
                self.events.publish("stored", entry.key, tier="dram", parent=entry.parent,
                                    depth=entry.depth)
        if self.write_through and self.ssd is not None and self.ssd.has_s3:
            durable = [(i, e) for i, e in zip(where, committed, strict=True)
                       if e is not None and e.expires_at is None]
            if durable:
                return self._put_through(request, statuses, durable)
        self._write_behind([e for e in committed if e is not None])
        return self._put_reply(request, statuses)

    async def _put_through(self, request: Request, statuses: list[Status],
                           durable: Sequence[tuple[int, Entry]]) -> Reply:
        """Write-through: answer once S3 has every chunk (NOT_DURABLE for those it has not)."""
        with tier_span(self._tracer(request), "kvpool.s3 write", keys=len(durable)):
            await self._write_through(statuses, durable)
        return self._put_reply(request, statuses)

    async def _write_through(self, statuses: list[Status],
                             durable: Sequence[tuple[int, Entry]]) -> None:
        ssd = self.ssd
        assert ssd is not None
        # chunks the index says S3 has: asked of S3 itself before they are acked as durable
        # (another node may have deleted one since this node's last LIST), and held
        # meanwhile, in case they have to be written after all
        known = [(i, e) for i, e in durable if e.key in ssd.s3_index]
        for _, entry in known:
            self.dram.hold(entry)
        try:
            there = await asyncio.gather(*(ssd.confirm(e.key) for _, e in known))
            confirmed = {i for (i, _), ok in zip(known, there, strict=True) if ok}
            await self._write_durable(statuses, [(i, e) for i, e in durable
                                                 if i not in confirmed])
        finally:
            for _, entry in known:
                self.dram.release(entry)

    async def _write_durable(self, statuses: list[Status],
                             durable: Sequence[tuple[int, Entry]]) -> None:
        """Write each chunk behind to the SSD and to S3; UNAVAILABLE where S3 lacks it."""
        ssd = self.ssd
        assert ssd is not None
        loop = asyncio.get_running_loop()
        waits: list[tuple[int, asyncio.Future[bool]]] = []
        for i, entry in durable:
            done: asyncio.Future[bool] = loop.create_future()
            self.dram.hold(entry)

            def finished(stored: bool, e: Entry = entry, f: asyncio.Future[bool] = done) -> None:
                self.dram.release(e)
                if not f.done():
                    f.set_result(stored)

            if not ssd.write(entry.key, entry.offset, entry.length, finished, durable=True):
                finished(False)
            waits.append((i, done))
        for i, done in waits:
            if not await done:
                statuses[i] = Status.UNAVAILABLE

    def _put_reply(self, request: Request, statuses: Sequence[Status]) -> Reply:
        for status in statuses:
            if status != Status.OK:
                self.stats.error(status, Op.PUT)
        return self._reply(request, [encode_statuses(statuses)])

    def _count_reads(self, entries: Sequence[Entry | None]) -> None:
        misses = entries.count(None)
        self.stats.hits += len(entries) - misses
        self.stats.misses += misses

    def get(self, request: Request) -> Reply | Pending:
        return self._get(request, None)

    def _get(self, request: Request, leasing: Session | None) -> Reply | Pending:
        """GET, or with ``leasing`` (GET_SHM) where the values lie in the arena, leased to
        that session until it releases them."""
        entries = self.dram.acquire_many(request.keys)
        if request.trace is not None and self.tracing is not None:
            trace.get_current_span().set_attribute(
                "kvpool.dram_hits", len(entries) - entries.count(None))
        ssd = self.ssd
        if ssd is not None and ssd.up:
            # with S3, a miss everywhere else asks S3 too: another node may have written the
            # chunk since our last LIST (EXISTS/LOOKUP never pay that round trip)
            promote = [i for i, e in enumerate(entries)
                       if e is None and (request.keys[i] in ssd.index or ssd.has_s3)]
            if promote:
                return self._get_promoting(request, entries, promote, leasing)
        return self._get_reply(request, entries, leasing)

    async def _get_promoting(self, request: Request, entries: list[Entry | None],
                             promote: Sequence[int], leasing: Session | None) -> Reply:
        await asyncio.gather(*(self._promote(request.keys[i], entries, i) for i in promote))
        return self._get_reply(request, entries, leasing)

    async def _promote(self, key: bytes, entries: list[Entry | None], i: int) -> None:
        """Read ``key`` from SSD into a fresh DRAM slot; on success ``entries[i]`` holds it."""
        ssd = self.ssd
        assert ssd is not None
        value_len = ssd.index.get(key)
        if value_len is None:
            if ssd.has_s3:
                await self._promote_from_s3(key, entries, i)
            return
        slot = self.dram.reserve(key, value_len)
        if slot is None:
            return
        with tier_span(self._span_tracer(), "kvpool.ssd read", bytes=value_len) as span:
            try:
                status = await ssd.read_into(key, slot.offset, value_len)
            except SsdUnavailableError:
                status = SsdStatus.ERROR
            if span is not None:
                span.set_attribute("kvpool.hit", status == SsdStatus.OK)
        if status != SsdStatus.OK:
            slot.release()
            return
        self._publish(slot, entries, i)

    async def _promote_from_s3(self, key: bytes, entries: list[Entry | None], i: int) -> None:
        """Fetch ``key`` from S3 (the worker verifies it), into DRAM, then behind to SSD."""
        ssd = self.ssd
        assert ssd is not None and ssd.has_s3
        with tier_span(self._span_tracer(), "kvpool.s3 read") as span:
            try:
                value_len = await ssd.fetch(key)
                if value_len is None:
                    return
                if span is not None:
                    span.set_attribute("kvpool.bytes", value_len)
                slot = self.dram.reserve(key, value_len)
                if slot is None:
                    return
                if not await ssd.copy(key, slot.offset, value_len):
                    slot.release()
                    return
            except SsdUnavailableError:
                return
        entry = self._publish(slot, entries, i)
        if entry is not None:
            self._write_behind([entry])

    def _publish(self, slot: Slot, entries: list[Entry | None], i: int) -> Entry | None:
        """Commit a promoted slot to DRAM and hold it for the reply being built."""
        (entry,) = self.dram.commit([slot])
        if entry is not None:
            self.dram.hold(entry)
            entries[i] = entry
            self.promotions += 1
            self.events.publish("stored", entry.key, tier="dram", depth=entry.depth)
        return entry

    def _evicted(self, entry: Entry) -> None:
        """DRAM made room by dropping ``entry``: an evicted or demoted event."""
        if not self.events.subscribers:
            return
        ssd = self.ssd
        lower = None
        if ssd is not None and ssd.up:
            lower = "ssd" if entry.key in ssd.index else "s3" if entry.key in ssd.s3_index \
                else None
        self.events.publish("demoted" if lower else "evicted", entry.key,
                            tier=lower or "dram", parent=entry.parent, depth=entry.depth)

    def _expired(self, entry: Entry) -> None:
        """DRAM dropped ``entry`` at the end of its TTL (a chunk with a TTL is DRAM-only)."""
        if self.events.subscribers:
            self.events.publish("expired", entry.key, tier="dram", parent=entry.parent,
                                depth=entry.depth)

    def ssd_evicted(self, key: bytes) -> None:
        """The SSD dropped ``key`` to make room: an evicted or demoted event, unless DRAM
        still holds it (then this node's view of the chunk has not changed)."""
        if not self.events.subscribers or self.dram.contains(key):
            return
        ssd = self.ssd
        in_s3 = ssd is not None and key in ssd.s3_index
        self.events.publish("demoted" if in_s3 else "evicted", key,
                            tier="s3" if in_s3 else "ssd")

    def get_shm(self, request: Request, session: Session) -> Reply | Pending:
        if self.shm is None or not session.shm:
            raise BadFrameError("GET_SHM needs a connection granted the shared-memory arena")
        return self._get(request, session)

    def release(self, request: Request, session: Session) -> Reply:
        if self.shm is None:
            raise BadFrameError("RELEASE needs a node with the shared-memory fast path")
        ids = decode_lease_ids(request.body, request.header.count)
        done = self.shm.release(session, ids)
        return self._reply(request, [encode_statuses(
            [Status.OK if d else Status.NOT_FOUND for d in done])])

    def touch(self, request: Request, session: Session) -> Reply:
        """Values a client read through the arena index: count them, as GET_SHM would."""
        shm = self.shm
        if shm is None or not session.shm:
            raise BadFrameError("TOUCH needs a connection granted the shared-memory arena")
        entries = self.dram.touch_many(request.keys)
        found = [e for e in entries if e is not None]
        # hits: the reported keys the node still holds (a client's TOUCH of keys the node
        # never had counts nothing), as the index counters below count them
        self.stats.hits += len(found)
        shm.counters.index_bytes_out += sum(e.length for e in found)
        shm.counters.index_items_out += len(found)
        self.stats.tokens_served += sum(e.num_tokens for e in found)
        return self._reply(request, [encode_statuses(
            [Status.NOT_FOUND if e is None else Status.OK for e in entries])])

    def put_shm(self, request: Request, session: Session) -> Reply:
        """Reserve a slot per item for the client to write into; they wait for COMMIT."""
        shm = self.shm
        if shm is None or not session.write:
            raise BadFrameError("PUT_SHM needs a connection granted the arena for writing")
        tenant = session.principal.quota_tenant
        keys = request.keys or [item.header.key for item in request.items]  # scoped, if any
        body: Buffers = []
        reserved = 0
        for key, item in zip(keys, request.items, strict=True):
            slot = self.dram.reserve(key, item.header.value_len, tenant)
            item.reservation = slot
            if slot is None:
                body.append(ShmItem(Status.NO_CAPACITY, 0, 0, 0).pack())
            else:
                body.append(ShmItem(Status.OK, slot.offset, slot.length, 0).pack())
                reserved += 1
        lease = shm.reserve(session, request.items) if reserved else 0
        return self._reply(request, [encode_lease_ids([lease]), *body])

    def commit(self, request: Request, session: Session) -> Reply | Pending:
        """Publish the slots of a PUT_SHM lease (NOT_FOUND for all: it had expired)."""
        shm = self.shm
        if shm is None or not session.write:
            raise BadFrameError("COMMIT needs a connection granted the arena for writing")
        (lease,) = decode_lease_ids(request.body, 1)
        items = shm.take(session, lease)
        count = request.header.count
        if items is None:
            self.stats.error(Status.NOT_FOUND, Op.COMMIT)
            return self._reply(request, [encode_statuses([Status.NOT_FOUND] * count)])
        if len(items) != count:
            for item in items:
                if item.reservation is not None:
                    item.reservation.release()
            raise BadFrameError(f"COMMIT of {count} items for a lease of {len(items)}")
        reserved = [i for i in items if i.reservation is not None]
        shm.counters.committed += len(reserved)
        shm.counters.bytes_in += sum(i.header.value_len for i in reserved)
        return self._store(request, items)

    def _shm_reply(self, request: Request, entries: list[Entry | None], session: Session
                   ) -> Reply:
        """Where each value lies in the arena; the entries stay held under one lease."""
        shm = self.shm
        assert shm is not None
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
        lease = shm.lease(session, found) if found else 0
        shm.counters.bytes_out += num_bytes
        shm.counters.items_out += len(found)
        self.stats.tokens_served += tokens
        return self._reply(request, [encode_lease_ids([lease]), *items])

    def _get_reply(self, request: Request, entries: list[Entry | None],
                   leasing: Session | None) -> Reply:
        self._count_reads(entries)  # every tier has been asked: what is None is a miss
        if leasing is not None:
            return self._shm_reply(request, entries, leasing)
        dram = self.dram
        body: Buffers = []
        held: list[Entry] = []
        num_bytes = tokens = 0
        miss = pack_get_item(Status.NOT_FOUND, 0)
        for entry in entries:
            if entry is None:
                body.append(miss)
                continue
            body.append(pack_get_item(Status.OK, entry.length))
            body.append(dram.view(entry))
            held.append(entry)
            num_bytes += entry.length
            tokens += entry.num_tokens
        self.stats.bytes_out += num_bytes
        self.stats.tokens_served += tokens
        reply = self._reply(request, body)
        reply.held = held
        reply.num_bytes = num_bytes
        return reply

    def exists(self, request: Request) -> Reply:
        tiers = bytes(self.tiers(request.keys))
        self.stats.lookup_chunks_found += len(tiers) - tiers.count(0)
        # statuses: OK (0) where a tier holds the key, NOT_FOUND (1) where none does
        statuses = tiers.translate(_STATUS_OF_TIER)
        return self._reply(request, [statuses, tiers])

    def delete(self, request: Request) -> Reply:
        deleted = self.delete_keys(request.keys)
        return self._reply(request, [encode_statuses(
            [Status.OK if d else Status.NOT_FOUND for d in deleted])])

    def delete_keys(self, keys: Sequence[bytes]) -> list[bool]:
        """Delete from every tier of this node; True where some tier held the key."""
        deleted = self.dram.delete_many(keys)
        # the highest tier that held each key, for the removed events
        tiers = ["dram" if gone else "" for gone in deleted]
        ssd = self.ssd
        if ssd is not None and ssd.up:
            for i, key in enumerate(keys):
                if ssd.holds(key):
                    if not deleted[i]:
                        tiers[i] = "ssd" if key in ssd.index or key not in ssd.s3_index \
                            else "s3"
                    deleted[i] = True
                    ssd.delete(key)
        if self.events.subscribers:
            for key, tier in zip(keys, tiers, strict=True):
                if tier:
                    self.events.publish("removed", key, tier=tier)
        return deleted

    # -- admin ----------------------------------------------------------------------------

    def chunk_info(self, key: bytes) -> dict[str, Any] | None:
        """What this node knows of one chunk, without reading it (None: no tier has it)."""
        entry = self.dram.peek(key)
        ssd = self.ssd
        on_ssd = ssd is not None and ssd.up and key in ssd.index
        in_s3 = ssd is not None and ssd.up and key in ssd.s3_index
        tiers = [name for name, held in (("dram", entry is not None), ("ssd", on_ssd),
                                         ("s3", in_s3)) if held]
        if not tiers:
            return None
        info: dict[str, Any] = {"key": key.hex(), "tiers": tiers, "pinned": False,
                                "ttl_s": None, "last_access": None, "depth": None,
                                "num_tokens": None, "parent": None, "size_bytes": None}
        if entry is not None:
            info.update(size_bytes=entry.length, pinned=entry.pinned,
                        ttl_s=self.dram.ttl_left(entry), last_access=entry.last_access,
                        depth=entry.depth, num_tokens=entry.num_tokens,
                        parent=entry.parent.hex() if entry.parent else None)
        elif on_ssd:
            assert ssd is not None
            info["size_bytes"] = ssd.index[key]
        return info

    def evict(self, tier: str | None, namespace: bytes | None) -> dict[str, int]:
        """Drop unpinned chunks: all of ``tier`` (dram or ssd), or ``namespace``'s in DRAM.

        An eviction, not a delete: S3 keeps its copies (it is the cluster's, and a chunk
        evicted from the SSD is still served from there)."""
        counts = {"dram": 0, "ssd": 0}
        if tier in (None, "dram"):
            keep = None
            if namespace is not None:
                dram = self.dram

                def keep(entry: Entry) -> bool:
                    return bytes(dram.view(entry)[40:56]) != namespace  # envelope fingerprint

            for entry in self.dram.evict_where(keep):
                counts["dram"] += 1
                self._evicted(entry)
        if tier == "ssd" and self.ssd is not None and self.ssd.up:
            for key in list(self.ssd.index):
                self.ssd.evict(key)
                counts["ssd"] += 1
        return counts

    async def flush(self, timeout_s: float) -> dict[str, Any]:
        """Wait until the write-behind queue is empty (or ``timeout_s`` passes)."""
        ssd = self.ssd
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # polled: the queue drains through SSD-worker replies, which signal nothing else
        while ssd is not None and ssd.up and ssd.counters.pending_writes \
                and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        pending = ssd.counters.pending_writes if ssd is not None and ssd.up else 0
        return {"flushed": pending == 0, "pending_writes": pending}

    def lookup(self, request: Request) -> Reply:
        tiers = self.tiers(request.keys)
        num = tiers.index(0) if 0 in tiers else len(tiers)
        self.stats.lookup_chunks_found += num
        return self._reply(request, [encode_lookup_reply(tiers[:num])])

    def tiers(self, keys: Sequence[bytes]) -> list[int]:
        """The fastest tier holding each key (a Tier), 0 where none does. No I/O."""
        in_dram = self.dram.contains_many(keys)
        ssd = self.ssd
        if ssd is None or not ssd.up:
            return [Tier.DRAM if d else 0 for d in in_dram]
        index, s3_index = ssd.index, ssd.s3_index
        return [Tier.DRAM if d else Tier.SSD if k in index else Tier.S3 if k in s3_index else 0
                for d, k in zip(in_dram, keys, strict=True)]

    def _write_behind(self, entries: Sequence[Entry]) -> None:
        ssd = self.ssd
        if ssd is None:
            return  # (a worker that is down sheds, and counts, every write)
        dram = self.dram
        for entry in entries:
            if entry.expires_at is not None:
                # a chunk with a TTL lives in DRAM only, so it can never outlive its TTL
                if entry.key in ssd.index:
                    ssd.delete(entry.key)
                continue
            if entry.key in ssd.index:  # content-addressed: the SSD copy is the same bytes
                continue
            dram.hold(entry)
            if not ssd.write(entry.key, entry.offset, entry.length,
                             lambda _stored, e=entry: dram.release(e),  # type: ignore[misc]
                             tenant=entry.tenant):
                dram.release(entry)

    def pin(self, request: Request) -> Reply:
        return self._pin(request, True)

    def unpin(self, request: Request) -> Reply:
        return self._pin(request, False)

    def node_stats(self, request: Request) -> Pending:
        if request.body:
            raise BadFrameError("STATS takes no body")
        return self._stats_reply(request)

    async def _stats_reply(self, request: Request) -> Reply:
        return self._reply(request, [encode_json(await self.snapshot())])

    # -- helpers --------------------------------------------------------------------------

    async def snapshot(self) -> dict[str, Any]:
        dram = self.dram.stats()
        tiers: dict[str, Any] = {"dram": dram.to_dict()}
        if self.ssd is not None:
            tiers["ssd"] = await self._ssd_stats(self.ssd)
            s3 = tiers["ssd"].pop("s3", None)
            if s3 is not None:
                tiers["s3"] = {"name": "s3", "keys_known": len(self.ssd.s3_index), **s3}
        return {
            "node_id": self.node_id,
            "protocol": PROTOCOL_VERSION,
            "uptime_s": round(time.time() - self.started_at, 3),
            "capacity_bytes": dram.capacity_bytes,
            "used_bytes": dram.used_bytes,
            "num_objects": dram.num_objects,
            "evictions": dram.evictions,
            "promotions": self.promotions,
            "cluster_epoch": self.epoch,
            "wrong_owner": self.wrong_owner,
            "auth": {"mode": "open" if self.auth.open else "tokens",
                     "tokens": len(self.auth.entries), "failures": self.auth_failures,
                     "quota_evictions": self.dram.quota_evictions,
                     "quota_rejections": self.dram.quota_rejections,
                     "ssd_quota_evictions": self.ssd.quota_evictions if self.ssd else 0},
            "events": {"subscribers": len(self.events.subscribers),
                       "published": self.events.published, "lost": self.events.lost},
            "tiers": tiers,
            **self.stats.to_dict(),
            **{name: fn() for name, fn in self.extra_stats.items()},
        }

    @staticmethod
    async def _ssd_stats(ssd: SsdTier) -> dict[str, Any]:
        info: dict[str, Any] = {"name": "ssd", "up": ssd.up, "full": ssd.full,
                                "capacity_bytes": ssd.capacity_bytes,
                                "codec": CODEC_NAMES[ssd.codec], "num_objects": len(ssd.index),
                                "raw_bytes": sum(ssd.index.values()), **asdict(ssd.counters)}
        if ssd.up:
            try:
                async with asyncio.timeout(2):
                    worker = await ssd.worker_stats()
            except (SsdUnavailableError, TimeoutError):
                info["worker"] = "no answer"
            else:
                for name in ("used_bytes", "hits", "misses", "insertions", "evictions",
                             "rejections", "corrupt", "s3"):
                    if name in worker:
                        info[name] = worker[name]
        return info

    def _pin(self, request: Request, pinned: bool) -> Reply:
        done = self.dram.pin_many(request.keys, pinned)
        return self._reply(request, [encode_statuses(
            [Status.OK if d else Status.NOT_FOUND for d in done])])

    def _reply(self, request: Request, body: Buffers) -> Reply:
        header = request.header
        count = header.count if header.op != Op.LOOKUP else 1
        if header.op in (Op.HELLO, Op.STATS, Op.CLUSTER):
            count = 0
        return Reply(encode_frame(header.op, header.request_id, body, count=count,
                                  epoch=self.membership.epoch))
