"""One node's connections and the per-node half of every op (the router is in ``_async``).

:class:`NodeClient` speaks the wire protocol to one node: a small pool of
pipelined connections, batches split by the node's limits, reads checksummed
as they arrive. It returns raw per-key outcomes (statuses, tier codes,
payload views); :class:`kvpool.client.AsyncClient` turns them into the
public API, for one node or many.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, cast, overload
from urllib.parse import urlsplit

from kvpool.client import _plans as plans
from kvpool.client._connection import Buffer, BufferOrSegments, Connection
from kvpool.client._options import SHM_PUT_MIN_BYTES, ClientOptions
from kvpool.client._shm import TORN, ShmMapping, redeem
from kvpool.placement.keys import key_from_hex
from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE
from kvpool.protocol.errors import (
    ConfigError,
    InvalidArgumentError,
    InvalidKeyError,
    KvpoolConnectionError,
    KvpoolError,
    KvpoolTimeoutError,
    Status,
    WrongOwnerError,
    error_for_status,
)
from kvpool.protocol.frames import (
    KEY_SIZE,
    PROTOCOL_VERSION,
    Op,
    ShmItem,
    Tier,
    decode_json,
    decode_shm_reply,
    decode_statuses,
    encode_json,
    encode_lease_ids,
)
from kvpool.protocol.host import host_id
from kvpool.protocol.parsers import TOO_SMALL, Reply, Segments

__all__ = ["DEFAULT_PORT", "SHM_PUT_MIN_BYTES", "Key", "NodeClient", "join_keys", "key_bytes",
           "parse_seeds", "parse_url"]

log = logging.getLogger("kvpool.client")
T = TypeVar("T")

Key = bytes | str
DEFAULT_PORT = 7700
#: the epoch of the cluster map the current call was routed by (0: the node's own
#: ``epoch``). A frame must carry that epoch, not whatever map is installed by the time
#: it is encoded: a node trusts a frame of its own epoch without checking ownership, so
#: a frame routed by an old map but stamped with the new epoch would be stored on a node
#: that no longer owns the key, where no reader looks for it.
routed_by: contextvars.ContextVar[int] = contextvars.ContextVar("kvpool_routed_by", default=0)
_TIER_NAMES = {int(t): t.name.lower() for t in Tier}
#: back-off doublings past which the back-off is at its ceiling whatever the start
_MAX_DOUBLINGS = 32
#: reads through the arena index are reported to the node (TOUCH: its hit counts, byte
#: counts and LRU recency) once this many are waiting, or this long after the first
TOUCH_BATCH = 256
TOUCH_DELAY_S = 0.05


def _ignore_result(future: asyncio.Future[Any]) -> None:
    """A RELEASE reply: nothing to do (a failed connection ends its leases anyway)."""
    if not future.cancelled():
        future.exception()


def parse_url(url: str) -> tuple[str, int]:
    """``kvpool://host:port`` (or ``host:port``) -> (host, port)."""
    parts = urlsplit(url if "://" in url else f"kvpool://{url}")
    if parts.scheme != "kvpool":
        raise ConfigError(f"node URL must start with kvpool://, got {url!r}")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise ConfigError(f"bad port in node URL {url!r}") from None
    if not parts.hostname:
        raise ConfigError(f"no host in node URL {url!r}")
    return parts.hostname, port


def parse_seeds(url: str | Sequence[str]) -> list[tuple[str, int]]:
    """Node URLs -> [(host, port)]: one URL, a list of them, or comma-separated seeds as
    ``kvpool cluster up`` prints them (``kvpool://h:p,h:p,...``, the scheme written once or
    on each, or left out)."""
    items = [url] if isinstance(url, str) else list(url)
    seeds = []
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(f"a node URL is a str, got {type(item).__name__}")
        body = item.strip()
        scheme = ""
        if "," in body and "://" in body.split(",", 1)[0]:
            scheme, body = body.split("://", 1)
            scheme += "://"
        for raw in body.split(","):
            part = raw.strip()
            if part:
                seeds.append(parse_url(part if "://" in part else scheme + part))
    if not seeds:
        raise ConfigError(f"no node URL in {url!r}")
    return seeds


def key_bytes(key: Key) -> bytes:
    if isinstance(key, str):
        return key_from_hex(key)
    if not isinstance(key, bytes | bytearray | memoryview):
        raise InvalidKeyError(f"a key is bytes or a hex str, got {type(key).__name__}")
    if len(key) != KEY_SIZE:
        raise InvalidKeyError(f"a key is {KEY_SIZE} bytes, got {len(key)}")
    return bytes(key)


def join_keys(keys: Sequence[Key]) -> bytes:
    """All keys as one validated 16*n byte blob: the body of a key-list frame."""
    try:
        blob = b"".join(keys)  # type: ignore[arg-type]  # fast path: all bytes-like
    except TypeError:
        return b"".join([key_bytes(k) for k in keys])
    if len(blob) != KEY_SIZE * len(keys) or any(n != KEY_SIZE for n in map(len, keys)):
        return b"".join([key_bytes(k) for k in keys])  # raises InvalidKeyError for the bad one
    return blob


#: the longest TTL a PUT can carry: a u32 of milliseconds, ~49.7 days
MAX_TTL_S = 0xFFFFFFFF / 1000


def _ttl_ms(ttl: float | None) -> int:
    if ttl is None:
        return 0
    if not 0 < ttl <= MAX_TTL_S:  # NaN fails this too
        raise InvalidArgumentError(
            f"ttl must be seconds in (0, {MAX_TTL_S:.3f}] (~49.7 days), got {ttl!r}; give "
            "None for the node default TTL, or pin=True to keep a chunk until unpinned")
    return max(1, int(ttl * 1000))


def check_u32(name: str, value: int) -> None:
    """InvalidArgumentError unless ``value`` fits the envelope's u32 field ``name``."""
    if not 0 <= value <= 0xFFFFFFFF:
        raise InvalidArgumentError(f"{name} must be in [0, 2**32), got {value!r}")


class NodeClient:
    """Connections to one node, its limits, and whether it is reachable right now.

    A node that fails a connect, a call or a deadline is *down* for a back-off
    period (0.25 s, doubling up to 5 s); :attr:`live` turns true again after
    it, and the next call probes the node. (5 s: a restarted node is back in
    use within seconds, and a dead one costs a failed connect every 5 s.)
    """

    BACKOFF_START_S = 0.25
    BACKOFF_MAX_S = 5.0

    def __init__(self, host: str, port: int, options: ClientOptions | None = None, *,
                 node_id: str = "") -> None:
        self.host, self.port = host, port
        self.options = options = options or ClientOptions()
        self._map: ShmMapping | None = None
        #: payload bytes received, by path ("shm", "tcp")
        self.bytes_by_path = {"shm": 0, "tcp": 0}
        #: payload bytes stored, by path
        self.put_bytes_by_path = {"shm": 0, "tcp": 0}
        #: PUT_SHM leases that ended before their COMMIT (the values went again over TCP)
        self.shm_put_expired = 0
        #: fast-path values freed while they were copied (fetched again over TCP)
        self.shm_torn = 0
        #: values read through the index; found there but stale (asked with GET_SHM)
        self.index_hits = 0
        self.index_stale = 0
        #: keys read through the index and not yet reported (TOUCH), since when
        self._touched: list[bytes] = []
        self._touched_count = 0
        self._touched_since = 0.0
        self._touch_timer: asyncio.TimerHandle | None = None
        self.node_id = node_id or f"{host}:{port}"
        self._slots: list[Connection | None] = [None] * options.pool_size
        self._connecting: dict[int, asyncio.Future[Connection]] = {}
        self._next_slot = 0
        self.server_info: dict[str, Any] = {}
        #: the cluster-map epoch requests are routed with (0 = standalone)
        self.epoch = 0
        #: called with a reply's epoch when it is newer than :attr:`epoch`
        self.on_newer_epoch: Callable[[int], None] | None = None
        self.num_corrupt = 0
        self.failures = 0
        self.down_until = 0.0

    # -- health ---------------------------------------------------------------------------

    @property
    def live(self) -> bool:
        return self.failures == 0 or time.monotonic() >= self.down_until

    def mark_down(self) -> None:
        self.failures += 1
        # the exponent stops growing once past the ceiling: 2.0 ** 1024 overflows a float,
        # which a node down for long enough (or a whole cluster) would otherwise reach
        doublings = min(self.failures - 1, _MAX_DOUBLINGS)
        backoff = min(self.BACKOFF_MAX_S, self.BACKOFF_START_S * 2.0 ** doublings)
        self.down_until = time.monotonic() + backoff
        log.info("kvpool node %s marked down for %.2fs (%d failures in a row)", self.node_id,
                 backoff, self.failures)
        self.close()

    def close(self) -> None:
        """Close the connections (reads through the index still to report are sent first,
        when the caller's loop runs)."""
        if self._touched:
            with contextlib.suppress(RuntimeError):  # no running loop: they are dropped
                asyncio.get_running_loop()
                self._send_touch(None)
        if self._touch_timer is not None:
            self._touch_timer.cancel()
            self._touch_timer = None
        for i, conn in enumerate(self._slots):
            if conn is not None:
                conn.close()
            self._slots[i] = None

    def close_mapping(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    async def connect(self) -> None:
        await self._connection()

    # -- ops: raw per-key outcomes --------------------------------------------------------

    async def put(self, bkeys: Sequence[bytes], values: Sequence[BufferOrSegments], *,
                  ttl_ms: int,
                  flags: int, chunk_indexes: Sequence[int] | None, num_tokens: int,
                  fingerprint: bytes, parents: Sequence[bytes | None] | None = None
                  ) -> list[int]:
        """One Status per key, in as few frames as the node's limits allow.

        A call whose values total at least :attr:`shm_put_min_bytes` goes through
        the arena when the node granted this client writes (PUT_SHM, then COMMIT);
        smaller ones over TCP.
        """
        conn = await self._connection()
        items = plans.put_items(self, bkeys, values, ttl_ms=ttl_ms, flags=flags,
                                chunk_indexes=chunk_indexes, parents=parents)
        statuses = [0] * len(items)
        by_tcp = items
        shm = self._map
        if shm is not None and conn.shm_write and self.puts_by_shm(items):
            # those whose slots were given back before COMMIT are sent again over TCP
            by_tcp = await self._put_shm(conn, shm, items, statuses, num_tokens=num_tokens,
                                         fingerprint=fingerprint)
        if by_tcp:
            await self.run(plans.put_tcp(self, by_tcp, statuses, num_tokens=num_tokens,
                                         fingerprint=fingerprint), conn)
        return statuses

    async def _put_shm(self, conn: Connection, shm: ShmMapping, items: list[plans.PutItem],
                       statuses: list[int], *, num_tokens: int, fingerprint: bytes
                       ) -> list[plans.PutItem]:
        """PUT_SHM, write each value into its slot, COMMIT; the items whose lease expired."""
        frames = plans.frames(self, items)
        replies = await self._gather([
            (conn, Op.PUT_SHM, len(frame), [b for it in frame for b in it.head()], None)
            for frame in frames])
        commits: list[tuple[Connection, int, int, list[Buffer], None]] = []
        committing: list[list[plans.PutItem]] = []
        writes: list[tuple[ShmItem, Sequence[memoryview], int]] = []
        for frame, reply in zip(frames, replies, strict=True):
            lease, slots = decode_shm_reply(reply.body, len(frame))
            for item, slot in zip(frame, slots, strict=True):
                if slot.status == Status.OK:
                    writes.append((slot, item.parts, item.chunk_index))
                else:
                    statuses[item.index] = slot.status
            if lease:
                commits.append((conn, Op.COMMIT, len(frame), [encode_lease_ids([lease])], None))
                committing.append(frame)
        shm.write_many(writes, num_tokens=num_tokens, fingerprint=fingerprint)
        expired: list[plans.PutItem] = []
        for frame, reply in zip(committing, await self._gather(commits), strict=True):
            for item, status in zip(frame, decode_statuses(reply.body, len(frame)), strict=True):
                if status == Status.NOT_FOUND:  # the lease ended before COMMIT: not stored
                    expired.append(item)
                    continue
                statuses[item.index] = status
                if status == Status.OK:
                    self.put_bytes_by_path["shm"] += item.nbytes
        self.shm_put_expired += len(expired)
        return expired

    def puts_by_shm(self, items: Sequence[plans.PutItem]) -> bool:
        """Whether a put of ``items`` goes through the arena (else over TCP): the node
        granted this client writes, and the values total ``shm_put_min_bytes`` or more."""
        shm = self._map
        return shm is not None and shm.writable and self.options.shm is not False \
            and sum(it.nbytes for it in items) >= self.options.shm_put_min_bytes

    @property
    def gets_by_shm(self) -> bool:
        """Whether GETs go through the arena (else over TCP): the node granted it."""
        return self._map is not None and self.options.shm is not False

    async def get(self, blob: bytes, sinks: Sequence[memoryview | Segments] | None
                  ) -> list[memoryview | Segments | None]:
        """Payload views (None for misses and corrupt chunks, which are deleted here)."""
        conn = await self._connection()
        if conn.shm and self._map is not None and self.gets_by_shm:
            return await self._get_shm(conn, self._map, blob, sinks)
        return await self.run(plans.get_tcp(self, blob, sinks), conn)

    async def _get_shm(self, conn: Connection, shm: ShmMapping, blob: bytes,
                       sinks: Sequence[memoryview | Segments] | None
                       ) -> list[memoryview | Segments | None]:
        """GET through the arena: values the arena index has are copied with no request
        (and reported later, in one TOUCH for many calls); the rest are asked for with
        GET_SHM."""
        if not self.options.shm_index or shm.index is None:
            return await self._get_leased(conn, shm, blob, sinks)
        out, rest = self._read_indexed(shm, blob, sinks, all_or_none=False)
        self.touch_later(conn)
        if rest:
            again = await self._get_leased(conn, shm, plans.rows_blob(blob, rest),
                                           [sinks[i] for i in rest] if sinks is not None
                                           else None)
            for i, payload in zip(rest, again, strict=True):
                out[i] = payload
        return out

    def read_local(self, blob: bytes, sinks: Sequence[memoryview | Segments] | None
                   ) -> list[memoryview | Segments | None] | None:
        """The whole GET from the arena index, in this thread and with no event loop;
        None where any key is not there (ask with :meth:`get`, which reads them all).

        Only where :attr:`can_read_local` (the caller asks): with a connection that is,
        as far as this thread has seen, open -- the sync client runs its loop before
        such a read if it has not for ``TOUCH_DELAY_S``, and so hears of a node that
        went away.
        """
        shm = self._map
        assert shm is not None
        found = self._read_indexed(shm, blob, sinks, all_or_none=True)
        return found[0] if found is not None else None

    @property
    def can_read_local(self) -> bool:
        """Whether :meth:`read_local` may answer (a mapped index, a granted connection)."""
        shm = self._map
        return shm is not None and shm.index is not None and self.options.shm_index \
            and self.options.shm is not False and self._shm_conn() is not None

    def _shm_conn(self) -> Connection | None:
        """An open connection granted the arena (as far as this thread has seen)."""
        for conn in self._slots:
            if conn is not None and conn.is_open and conn.shm:
                return conn
        return None

    @overload
    def _read_indexed(self, shm: ShmMapping, blob: bytes,
                      sinks: Sequence[memoryview | Segments] | None, *, all_or_none: Literal[False]
                      ) -> tuple[list[memoryview | Segments | None], list[int]]: ...

    @overload
    def _read_indexed(self, shm: ShmMapping, blob: bytes,
                      sinks: Sequence[memoryview | Segments] | None, *, all_or_none: Literal[True]
                      ) -> tuple[list[memoryview | Segments | None], list[int]] | None: ...

    def _read_indexed(self, shm: ShmMapping, blob: bytes,
                      sinks: Sequence[memoryview | Segments] | None, *, all_or_none: bool
                      ) -> tuple[list[memoryview | Segments | None], list[int]] | None:
        """Copy what the arena index has: ``(payloads, rows not read)``, the reads noted
        for the next TOUCH. ``all_or_none``: None, having copied nothing, unless every
        key is there (then copies that came out stale give None too: nothing is noted)."""
        index = shm.index
        assert index is not None
        count = len(blob) // KEY_SIZE
        out: list[memoryview | Segments | None] = [None] * count
        if index.epoch != (routed_by.get() or self.epoch):  # GET_SHM: WRONG_OWNER, or the map
            return None if all_or_none else (out, list(range(count)))
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
            self.index_hits += len(hits)
            self.bytes_by_path["shm"] += nbytes
            if not self._touched:
                self._touched_since = time.monotonic()
            self._touched.append(plans.rows_blob(blob, hits))
            self._touched_count += len(hits)
        if len(hits) == count:
            return out, []
        hit = set(hits)
        return out, [i for i in range(count) if i not in hit]

    @property
    def touch_due(self) -> bool:
        """Reads through the index wait to be reported: enough of them, or for long enough."""
        return bool(self._touched) and (
            self._touched_count >= TOUCH_BATCH
            or time.monotonic() - self._touched_since >= TOUCH_DELAY_S)

    def touch_later(self, conn: Connection | None = None) -> None:
        """Send the reads through the index as one TOUCH now if due, else soon (a timer):
        the node counts them and refreshes their recency. Needs the running loop."""
        if not self._touched:
            return
        if self.touch_due:
            self._send_touch(conn)
        elif self._touch_timer is None:
            self._touch_timer = asyncio.get_running_loop().call_later(
                TOUCH_DELAY_S, self._send_touch, None)

    async def flush_touches(self) -> None:
        """Report the reads through the index now, and wait until the node has counted
        them (so the stats asked next include them)."""
        if self._touched:
            sent = self._send_touch(None)
            if sent:
                await asyncio.wait(sent)

    def _send_touch(self, conn: Connection | None) -> list[asyncio.Future[Reply]]:
        """The TOUCH frames sent (none: nothing to report, or no connection for it)."""
        if self._touch_timer is not None:
            self._touch_timer.cancel()
            self._touch_timer = None
        if conn is None or not conn.is_open:
            conn = self._shm_conn()
        keys, count = b"".join(self._touched), self._touched_count
        self._touched.clear()
        self._touched_count = 0
        sent: list[asyncio.Future[Reply]] = []
        if conn is None:  # the connection is gone: so is what it would count
            return sent
        for part in plans.chunks(count, int(self.server_info["max_batch"])):
            try:
                touch = conn.send(Op.TOUCH, len(part), [plans.blob_part(keys, part)],
                                  epoch=self.epoch)
            except KvpoolError:
                break
            touch.add_done_callback(_ignore_result)
            sent.append(touch)
        return sent

    async def _get_leased(self, conn: Connection, shm: ShmMapping, blob: bytes,
                          sinks: Sequence[memoryview | Segments] | None
                          ) -> list[memoryview | Segments | None]:
        """GET_SHM: copy each value from the mapping, then release the lease."""
        max_batch = int(self.server_info["max_batch"])
        parts = plans.chunks(len(blob) // KEY_SIZE, max_batch)
        replies = await self._gather([(conn, Op.GET_SHM, len(p), [plans.blob_part(blob, p)], None)
                                      for p in parts])
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
                self.bytes_by_path["shm"] += item.length - ENVELOPE_HEADER_SIZE
            elif status == TORN:
                torn.append(i)
            elif status == TOO_SMALL and too_small < 0:
                too_small = i
            elif status == Status.CORRUPT:
                corrupt.append(plans.blob_part(blob, range(i, i + 1)))
        if leases:  # copied: the node may evict those values again (no need to wait)
            release = conn.send(Op.RELEASE, len(leases), [encode_lease_ids(leases)],
                                epoch=self.epoch)
            release.add_done_callback(_ignore_result)
        if too_small >= 0:
            plans.too_small(blob, too_small, sinks)
        if torn:  # freed (and maybe reused) mid-copy: ask again over TCP
            self.shm_torn += len(torn)
            again = await self.run(plans.get_tcp(
                self, plans.rows_blob(blob, torn),
                [sinks[i] for i in torn] if sinks is not None else None), conn)
            for i, payload in zip(torn, again, strict=True):
                out[i] = payload
        await self.run(plans.drop_corrupt(self, corrupt), conn)
        return out

    async def exists(self, blob: bytes) -> bytes:
        """One tier code per key, 0 where absent."""
        return await self.run(plans.exists(self, blob))

    async def lookup(self, blob: bytes) -> list[int]:
        """Tier codes of the leading keys the node holds (LOOKUP stops at the first miss)."""
        return await self.run(plans.lookup(self, blob))

    async def statuses(self, op: Op, blob: bytes) -> list[int]:
        return await self.run(plans.statuses(self, op, blob))

    async def json_op(self, op: Op) -> dict[str, Any]:
        """STATS or CLUSTER: an empty request, a JSON reply."""
        return await self.run(plans.json_op(op))

    async def run(self, plan: plans.Plan[T], conn: Connection | None = None) -> T:
        """Drive ``plan`` over the pooled connections (``conn``, or the next of the pool):
        each round of its frames sent at once, their replies sent back to it."""
        if conn is None:
            conn = await self._connection()  # plans read the limits HELLO gave
        try:
            calls = next(plan)
        except StopIteration as done:  # nothing to send
            return cast(T, done.value)
        while True:
            replies = await self._gather([(conn, *call) for call in calls])
            try:
                calls = plan.send(replies)
            except StopIteration as done:
                return cast(T, done.value)

    # -- internals ------------------------------------------------------------------------

    async def _gather(self, calls: Sequence[tuple[Connection, int, int, Sequence[Buffer],
                                                  Sequence[memoryview | Segments | None] | None]]
                      ) -> list[Reply]:
        if len(calls) == 1:
            return [await self._call(*calls[0])]
        return list(await asyncio.gather(*(self._call(*c) for c in calls)))

    async def _call(self, conn: Connection, op: int, count: int, body: Sequence[Buffer],
                    sinks: Sequence[memoryview | Segments | None] | None = None) -> Reply:
        # the connection enforces the deadline
        return self.check(
            await conn.send(op, count, body, sinks, epoch=routed_by.get() or self.epoch))

    def check(self, reply: Reply) -> Reply:
        """A reply as the caller gets it: the error its status names raised; a newer map
        epoch noted (the cluster client refreshes its map)."""
        header = reply.header
        if header.epoch > self.epoch and self.on_newer_epoch is not None:
            self.on_newer_epoch(header.epoch)
        if header.status != Status.OK:
            error = error_for_status(header.status, bytes(reply.body).decode("utf-8", "replace"))
            if isinstance(error, WrongOwnerError):
                error.epoch = header.epoch
            raise error
        self.failures = 0
        return reply

    async def _connection(self) -> Connection:
        slot = self._next_slot
        self._next_slot = (slot + 1) % len(self._slots)
        conn = self._slots[slot]
        if conn is not None and conn.is_open:
            idle_s = self.server_info.get("idle_timeout_s") or 0
            if not idle_s or conn.num_pending or \
                    asyncio.get_running_loop().time() - conn.last_used < idle_s * 0.75:
                return conn
            conn.close()  # the node is about to close it (or has, unseen by a sync client)
        connecting = self._connecting.get(slot)
        if connecting is None:
            connecting = asyncio.ensure_future(self._open())
            self._connecting[slot] = connecting
            try:
                conn = await connecting
                self._slots[slot] = conn
            finally:
                del self._connecting[slot]
            return conn
        return await asyncio.shield(connecting)

    async def _open(self) -> Connection:
        loop = asyncio.get_running_loop()
        options = self.options
        try:
            async with asyncio.timeout(options.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Connection(options.timeout, f"{self.host}:{self.port}"),
                    self.host, self.port, ssl=options.ssl)
        except TimeoutError:
            raise KvpoolTimeoutError(
                f"connecting to {self.host}:{self.port} took longer than "
                f"{options.connect_timeout}s"
            ) from None
        except OSError as exc:  # ssl.SSLError included
            raise KvpoolConnectionError(
                f"cannot connect to kvpool node {self.host}:{self.port}: {exc}") from exc
        conn.scope_flags = options.scope_flags
        request: dict[str, Any] = {"protocol": PROTOCOL_VERSION,
                                   "client": options.client_name}
        if options.token:
            request["token"] = options.token
        if options.shm is not False:
            request.update(shm=True, host=host_id())
        try:
            reply = await self._call(conn, Op.HELLO, 0, [encode_json(request)])
        except BaseException:
            conn.close()
            raise
        self.server_info = decode_json(reply.body)
        offer = self.server_info.get("shm")
        if isinstance(offer, dict) and "refused" not in offer:
            try:  # in a thread: the node may share this event loop (a node's own peer client)
                fd, index_fd, writable = await asyncio.get_running_loop().run_in_executor(
                    None, redeem, offer, options.connect_timeout)
            except KvpoolConnectionError as exc:
                if options.shm:
                    conn.close()
                    raise
                log.info("%s: using TCP: %s", self.node_id, exc)
            else:
                if self._map is None or self._map.socket != offer["socket"] \
                        or self._map.writable != writable:
                    self.close_mapping()  # a restarted node has a new arena
                    self._map = ShmMapping(fd, offer, writable=writable, index_fd=index_fd)
                else:
                    os.close(fd)
                    if index_fd >= 0:
                        os.close(index_fd)
                conn.shm = True
                conn.shm_write = writable
        elif options.shm:
            conn.close()
            refused = offer.get("refused") if isinstance(offer, dict) else None
            raise KvpoolConnectionError(
                f"node {self.node_id} offers no shared-memory fast path: "
                + (str(refused) if refused else "another host, or started with --no-shm"))
        return conn
