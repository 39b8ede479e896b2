"""What each opcode does on a node: decode the request, ask the tiers, encode the reply.

A handler returns the reply as a list of buffers (values are arena
memoryviews, never copied) plus the DRAM entries that must stay acquired
until those buffers have been written out. A GET that must promote chunks
from a lower tier returns a coroutine instead; the connection awaits it and
writes the reply when it is ready (replies carry request ids, so order is
free). Where chunks live and move is :class:`~kvpool.server.cold.tiering.TierManager`'s
business (``server/cold/tiering.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Tracer

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
    decode_json,
    encode_error,
    encode_frame,
    encode_json,
    encode_lookup_reply,
    encode_statuses,
    pack_get_item,
)
from kvpool.protocol.parsers import Limits, PutItem, Request
from kvpool.server.admin.events import EventBus
from kvpool.server.admin.tracing import NodeTracing, tier_span
from kvpool.server.cluster.membership import Membership
from kvpool.server.cold.tiering import TierManager
from kvpool.server.data.reply import Buffers, Pending, Reply
from kvpool.server.data.session import Session
from kvpool.server.data.shm import ShmService
from kvpool.server.data.shm_ops import ShmOps
from kvpool.server.data.snapshot import node_snapshot
from kvpool.server.data.stats import NodeStats
from kvpool.server.security.auth import ANONYMOUS, Role, TokenTable
from kvpool.tiers.dram import Entry, Slot

__all__ = ["Handlers"]

_STATUS_OF_TIER = bytes([Status.NOT_FOUND] + [Status.OK] * 255)
#: ops whose keys are placed by the cluster map (a stale client may have sent them astray)
_ROUTED_OPS = frozenset({Op.PUT, Op.GET, Op.EXISTS, Op.DELETE, Op.LOOKUP, Op.PIN, Op.UNPIN,
                         Op.GET_SHM, Op.PUT_SHM, Op.COMMIT_AS})
_PUT_OPS = frozenset({Op.PUT, Op.PUT_SHM, Op.COMMIT_AS})
#: the same-host fast path's ops (server/data/shm_ops.py)
_SHM_OPS = (Op.GET_SHM, Op.RELEASE, Op.PUT_SHM, Op.COMMIT, Op.COMMIT_AS, Op.TOUCH)


class Handlers:
    """Dispatch table from opcode to handler, shared by every connection of a node."""

    def __init__(self, node_id: str, tiers: TierManager, limits: Limits, stats: NodeStats,
                 membership: Membership | None = None, *, auth: TokenTable | None = None,
                 idle_timeout_s: float = 0.0,
                 addresses: tuple[tuple[str, int], tuple[str, int]] = (("", 0), ("", 0)),
                 shm: ShmService | None = None, tracing: NodeTracing | None = None,
                 extra_stats: dict[str, Callable[[], Any]] | None = None) -> None:
        """A node's op table, made once the node knows all of this (its ports bound, its
        id from the cluster, the fast path and tracing started; its data port serves only
        then). ``shm``: serve the same-host fast path's ops (None: off)."""
        self.node_id = node_id
        self.store = tiers
        self.membership = membership or Membership()
        #: where the node listens, for the map a standalone node serves
        self.addresses = addresses
        self.wrong_owner = 0
        #: more sections of the stats snapshot (name -> function giving a JSON-able value)
        self.extra_stats = dict(extra_stats or {})
        self.dram = tiers.dram
        self.events: EventBus = tiers.events
        self.limits = limits
        self.stats = stats
        #: spans for requests that carry a trace context (None: tracing is not configured)
        self.tracing = tracing
        #: the node closes data connections idle this long (0: never); told in HELLO
        self.idle_timeout_s = idle_timeout_s
        #: tokens -> tenant and role (empty: open mode); replaced whole on SIGHUP
        self.auth = auth if auth is not None else TokenTable()
        self.auth_failures = 0
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
            **dict.fromkeys(_SHM_OPS, self._no_fast_path),
        }
        #: the same-host fast path's ops (None: off)
        self.shm_ops: ShmOps | None = None
        if shm is not None:
            self.shm_ops = ShmOps(shm, self.dram, self.stats, read=self._get,
                                  store=self._store, reply=self._reply,
                                  reused=self.store.reused)
            self._session_table.update(self.shm_ops.table)

    @property
    def shm(self) -> ShmService | None:
        """The fast path's leases and grants (None: off)."""
        return self.shm_ops.service if self.shm_ops is not None else None

    def _no_fast_path(self, request: Request, session: Session) -> Reply:
        raise BadFrameError(f"{Op(request.header.op).name} needs a node with the "
                            "shared-memory fast path")

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
                if header.op == Op.COMMIT_AS and self.shm_ops is not None:
                    self.shm_ops.abandon(request, session)
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
            "tenant": principal.tenant, "role": principal.role.name.lower(),
            # PUT items may carry their checksum after the value (PUT_FLAG_CHECKSUM_AFTER)
            "checksum_after": True,
        }
        if self.shm is not None:
            offer = self.shm.offer(session, body)
            if offer is not None:
                info["shm"] = offer
        return self._reply(request, [encode_json(info)])

    def put(self, request: Request) -> Reply | Pending:
        return self._store(request, request.items)

    def _store(self, request: Request, items: Sequence[PutItem], tail: Buffers | None = None
               ) -> Reply | Pending:
        """Publish received slots (a PUT's, or a committed PUT_SHM's); reply one Status each
        (then ``tail``: COMMIT_AS's next lease)."""
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
        committed = self.store.commit(slots, ttl_s=ttls, pin=pins, parents=parents)
        for i, entry in zip(where, committed, strict=True):
            if entry is None:
                statuses[i] = Status.CORRUPT
        durable = [(where[j], e) for j in self.store.through(committed)
                   if (e := committed[j]) is not None]
        if durable:
            return self._put_through(request, statuses, durable, tail)
        self.store.write_behind(e for e in committed if e is not None)
        return self._put_reply(request, statuses, tail)

    async def _put_through(self, request: Request, statuses: list[Status],
                           durable: Sequence[tuple[int, Entry]], tail: Buffers | None) -> Reply:
        """Write-through: answer once S3 has every chunk (UNAVAILABLE for those it has not)."""
        entries = [e for _, e in durable]
        with tier_span(self._tracer(request), "kvpool.s3 write", keys=len(entries)):
            done = await self.store.make_durable(entries)
        for (i, _), ok in zip(durable, done, strict=True):
            if not ok:
                statuses[i] = Status.UNAVAILABLE
        return self._put_reply(request, statuses, tail)

    def _put_reply(self, request: Request, statuses: Sequence[Status], tail: Buffers | None = None
                   ) -> Reply:
        for status in statuses:
            if status != Status.OK:
                self.stats.error(status, Op.PUT)
        return self._reply(request, [encode_statuses(statuses), *(tail or ())])

    def _count_reads(self, entries: Sequence[Entry | None]) -> None:
        misses = entries.count(None)
        self.stats.hits += len(entries) - misses
        self.stats.misses += misses

    def get(self, request: Request) -> Reply | Pending:
        return self._get(request, None)

    def _get(self, request: Request, leasing: Session | None) -> Reply | Pending:
        """GET, or with ``leasing`` (GET_SHM) where the values lie in the arena, leased to
        that session until it releases them."""
        entries = self.store.acquire(request.keys)
        if request.trace is not None and self.tracing is not None:
            trace.get_current_span().set_attribute(
                "kvpool.dram_hits", len(entries) - entries.count(None))
        promote = self.store.below(request.keys, entries)
        if promote:
            return self._get_promoting(request, entries, promote, leasing)
        return self._get_reply(request, entries, leasing)

    async def _get_promoting(self, request: Request, entries: list[Entry | None],
                             promote: Sequence[int], leasing: Session | None) -> Reply:
        await self.store.promote(request.keys, entries, promote)
        return self._get_reply(request, entries, leasing)

    def _get_reply(self, request: Request, entries: list[Entry | None],
                   leasing: Session | None) -> Reply:
        self._count_reads(entries)  # every tier has been asked: what is None is a miss
        if leasing is not None:
            assert self.shm_ops is not None  # a GET_SHM, answered where it lies
            return self.shm_ops.lease_reply(request, entries, leasing)
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
        tiers = self.store.tiers(request.keys)
        self.stats.lookup_chunks_found += len(tiers) - tiers.count(0)
        # statuses: OK (0) where a tier holds the key, NOT_FOUND (1) where none does
        statuses = tiers.translate(_STATUS_OF_TIER)
        return self._reply(request, [statuses, tiers])

    def delete(self, request: Request) -> Reply:
        deleted = self.store.delete(request.keys)
        return self._reply(request, [encode_statuses(
            [Status.OK if d else Status.NOT_FOUND for d in deleted])])

    def lookup(self, request: Request) -> Reply:
        tiers = self.store.tiers(request.keys)
        num = tiers.index(0) if 0 in tiers else len(tiers)
        self.stats.lookup_chunks_found += num
        return self._reply(request, [encode_lookup_reply(tiers[:num])])

    def pin(self, request: Request) -> Reply:
        return self._pin(request, True)

    def unpin(self, request: Request) -> Reply:
        return self._pin(request, False)

    def node_stats(self, request: Request) -> Pending:
        if request.body:
            raise BadFrameError("STATS takes no body")
        return self._stats_reply(request)

    async def _stats_reply(self, request: Request) -> Reply:
        return self._reply(request, [encode_json(await node_snapshot(self))])

    # -- helpers --------------------------------------------------------------------------

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
