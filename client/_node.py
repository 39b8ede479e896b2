"""One node's connections and the per-node half of every op (the router is in ``_async``).

:class:`NodeClient` speaks the wire protocol to one node: a small pool of
pipelined connections, batches split by the node's limits, reads checksummed
as they arrive. It returns raw per-key outcomes (statuses, tier codes,
payload views); :class:`kvpool.client.AsyncClient` turns them into the
public API, for one node or many.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

from kvpool.client import _plans as plans
from kvpool.client._connection import Buffer, BufferOrSegments, Connection
from kvpool.client._options import SHM_PUT_MIN_BYTES, ClientOptions
from kvpool.client._plans import routed_by
from kvpool.client._shm_path import ShmPath
from kvpool.client.paths import NodePath, OneSidedTransport
from kvpool.placement.keys import key_from_hex
from kvpool.protocol.errors import (
    ConfigError,
    InvalidArgumentError,
    InvalidKeyError,
    KvpoolTimeoutError,
    Status,
    WrongOwnerError,
    error_for_status,
)
from kvpool.protocol.frames import (
    KEY_SIZE,
    Op,
)
from kvpool.protocol.parsers import Reply, Segments

__all__ = ["DEFAULT_PORT", "SHM_PUT_MIN_BYTES", "Key", "NodeClient", "join_keys", "key_bytes",
           "parse_seeds", "parse_url"]

log = logging.getLogger("kvpool.client")
T = TypeVar("T")

Key = bytes | str
DEFAULT_PORT = 7700
#: back-off doublings past which the back-off is at its ceiling whatever the start
_MAX_DOUBLINGS = 32


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
    if len(blob) != KEY_SIZE * len(keys) or list(map(len, keys)).count(KEY_SIZE) != len(keys):
        return b"".join([key_bytes(k) for k in keys])  # raises InvalidKeyError for the bad one
    return blob


#: the longest TTL a PUT can carry: a u32 of milliseconds, ~49.7 days
MAX_TTL_S = 0xFFFFFFFF / 1000


def ttl_ms_of(ttl: float | None) -> int:
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
    use within seconds, and a dead one costs a failed connect every 5 s.) A node
    that let a deadline pass (hung, or a host that drops packets) is down for at
    least ten timeouts, up to a minute.

    A node that answers so far behind the others of a fan-out that the caller stops
    waiting for it (a straggler, see ``kvpool.client._routing``) is down for a second
    at least (:meth:`mark_slow`), its connections left as they are: a late answer
    still lands, and brings it back.

    Either way the node is *suspect* until it answers again: reads and writes (which
    wait for their node's answer) keep away from it while another node of a key's list
    is live (:attr:`trusted`), so once its back-off ends only questions that do not
    wait on it (EXISTS and lookups, which settle without stragglers) probe it.
    """

    BACKOFF_START_S = 0.25
    BACKOFF_MAX_S = 5.0
    #: after a timeout: down for this many timeouts at least, at most HUNG_BACKOFF_MAX_S
    HUNG_BACKOFF_TIMEOUTS = 10
    HUNG_BACKOFF_MAX_S = 60.0
    #: down for at least this long after a fan-out stopped waiting for it (a straggler)
    SLOW_BACKOFF_S = 1.0

    def __init__(self, host: str, port: int, options: ClientOptions | None = None, *,
                 node_id: str = "") -> None:
        self.host, self.port = host, port
        self.options = options = options or ClientOptions()
        #: how GETs and puts travel (``client/paths.py``): the transport's one-sided path,
        #: else the same-host arena path (TCP until a node on this host grants its arena)
        connector = options.connector
        self.path: NodePath = connector.one_sided(self) \
            if isinstance(connector, OneSidedTransport) else ShmPath(self)
        #: payload bytes received, by path ("shm", "tcp")
        self.bytes_by_path = {"shm": 0, "tcp": 0}
        #: payload bytes stored, by path
        self.put_bytes_by_path = {"shm": 0, "tcp": 0}
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
        #: it let a deadline pass or fell behind a fan-out, and has not answered since
        self.suspect = False
        #: settling questions (EXISTS, lookups) that stopped waiting for it (mark_slow)
        self.left_behind = 0

    # -- health ---------------------------------------------------------------------------

    @property
    def live(self) -> bool:
        """Not down: no failure since its last answer, or its back-off has ended."""
        return self.failures == 0 or time.monotonic() >= self.down_until

    @property
    def trusted(self) -> bool:
        """:attr:`live`, and not :attr:`suspect`: a read or a write waits for its node's
        answer, so it goes to a node that let a deadline pass or fell behind only where no
        other node of a key's list is live. (A node with no failure is never suspect.)"""
        return self.live and not self.suspect

    def mark_down(self, cause: BaseException | None = None) -> None:
        """Down for a back-off; longer where ``cause`` (the failure) is a timeout."""
        backoff = self._backoff()
        if isinstance(cause, KvpoolTimeoutError):
            self.suspect = True
            waited = max(self.options.timeout, self.options.connect_timeout)
            backoff = max(backoff, min(self.HUNG_BACKOFF_MAX_S,
                                       self.HUNG_BACKOFF_TIMEOUTS * waited))
        self._down_for(backoff)
        self.close()

    def mark_slow(self) -> None:
        """Down for a back-off of at least :attr:`SLOW_BACKOFF_S`: a fan-out stopped
        waiting for this node's answer. Its connections stay open (the answer may still
        come, and other calls may be using them); suspect until it answers."""
        self.suspect = True
        self.left_behind += 1
        self._down_for(max(self._backoff(), self.SLOW_BACKOFF_S))

    def _backoff(self) -> float:
        """One more failure counted; the back-off it earns (0.25 s doubling to 5 s)."""
        self.failures += 1
        # the exponent stops growing once past the ceiling: 2.0 ** 1024 overflows a float,
        # which a node down for long enough (or a whole cluster) would otherwise reach
        doublings = min(self.failures - 1, _MAX_DOUBLINGS)
        return min(self.BACKOFF_MAX_S, self.BACKOFF_START_S * 2.0 ** doublings)

    def _down_for(self, backoff: float) -> None:
        """Down ``backoff`` from now, or until a longer back-off already running ends (a
        lesser failure meanwhile, such as a connection the long one's close ended, does
        not cut it short)."""
        now = time.monotonic()
        self.down_until = max(self.down_until, now + backoff)
        log.info("kvpool node %s marked down for %.2fs (%d failures in a row)", self.node_id,
                 self.down_until - now, self.failures)

    def close(self) -> None:
        """Close the connections (reads through the index still to report are sent first,
        when the caller's loop runs)."""
        self.path.close()
        for i, conn in enumerate(self._slots):
            if conn is not None:
                conn.close()
            self._slots[i] = None

    def connections(self) -> list[Connection]:
        """The pool's open connections (as far as this thread has seen)."""
        return [conn for conn in self._slots if conn is not None and conn.is_open]

    async def connect(self) -> None:
        await self._connection()

    # -- ops: raw per-key outcomes --------------------------------------------------------

    async def put(self, bkeys: Sequence[bytes], values: Sequence[BufferOrSegments], *,
                  ttl_ms: int,
                  flags: int, chunk_indexes: Sequence[int] | None, num_tokens: int,
                  fingerprint: bytes, parents: Sequence[bytes | None] | None = None
                  ) -> list[int]:
        """One Status per key, in as few frames as the node's limits allow, through the
        arena or over TCP (:meth:`ShmPath.put` decides)."""
        conn = await self._connection()
        items = plans.put_items(self, bkeys, values, ttl_ms=ttl_ms, flags=flags,
                                chunk_indexes=chunk_indexes, parents=parents)
        return await self.path.put(conn, items, num_tokens=num_tokens,
                                   fingerprint=fingerprint)

    async def get(self, blob: bytes, sinks: Sequence[memoryview | Segments] | None
                  ) -> list[memoryview | Segments | None]:
        """Payload views (None for misses and corrupt chunks, which are deleted here),
        through the arena or over TCP (:meth:`ShmPath.get` decides)."""
        return await self.path.get(await self._connection(), blob, sinks)

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
        return await self.run(plans.json_op(self, op))

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
            replies = await self.gather([(conn, *call) for call in calls])
            try:
                calls = plan.send(replies)
            except StopIteration as done:
                return cast(T, done.value)

    # -- internals ------------------------------------------------------------------------

    async def gather(self, calls: Sequence[tuple[Connection, int, int, Sequence[Buffer],
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
        if self.failures:  # back: the back-off (and its length) start over
            self.failures = 0
            self.suspect = False
            self.down_until = 0.0
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
        options = self.options
        conn = await options.connector.open(
            self.host, self.port, options,
            lambda: Connection(options.timeout, f"{self.host}:{self.port}"))
        conn.scope_flags = options.scope_flags
        try:
            self.server_info = await self.run(plans.hello(
                self, options.client_name, options.token,
                arena=self.path.asks_grant), conn)
        except BaseException:
            conn.close()
            raise
        conn.limit_values(self.server_info["max_value_bytes"])
        try:
            await self.path.redeem(self.server_info, conn)
        except BaseException:
            conn.close()
            raise
        return conn
