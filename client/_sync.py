"""The blocking SDK: a thin facade that runs :class:`AsyncClient` on a private loop.

Each call runs the async core to completion on an event loop owned by this
client, in the calling thread: no helper thread, no second implementation.
Calls from several threads are serialised by a lock. Do not call it from
inside a running event loop; use :class:`AsyncClient` there.

Two exceptions skip the loop (a loop run costs ~40 us here, as much as copying
1 MiB, and more than a small request's round trip):

- a call to a standalone node that goes over TCP (every key op, GETs where the
  node grants no shared memory, puts below ``shm_put_min_bytes``), and a put
  through its arena (``client/_shm_put.py``), runs the
  same op plans as the async core (:mod:`kvpool.client._plans`) on a blocking
  socket of this client's own (:mod:`kvpool.client._blocking`), unless client
  spans are recorded; so a sync client holds one connection more than its
  pool. On a cluster, the key ops an engine's scheduler asks, ``exists*`` and
  ``lookup*``, do the same on the blocking sockets of the nodes asked, every
  frame sent before any reply is read
  (:func:`~kvpool.client._blocking.run_parallel`). A cluster's GETs send their first
  round so (each key to the first trusted node of its list; nodes whose arenas the
  client has not mapped: a same-host node's GETs go through its arena), and read the
  keys not found there on down their lists on the loop. A cluster's other calls run on
  the loop (its routing is async).
- a GET that a same-host node's arena index can answer whole is copied with
  no request at all (``ShmPath.read_local``). The loop still runs before such a read
when the reads before it are due to be reported, or when it has not run for
``TOUCH_DELAY_S`` (50 ms): so the client hears of a node that died (its
connection's end) before reading values frozen in its index.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

from opentelemetry.trace import TracerProvider

from kvpool.client import _cluster_ops as cluster_ops
from kvpool.client import _plans as plans
from kvpool.client._async import (
    AsyncClient,
    _bytearrays,
    _sinks,
    put_args,
    raise_put_errors,
)
from kvpool.client._blocking import BlockingNode, run_parallel
from kvpool.client._connection import BufferOrSegments
from kvpool.client._node import Key, NodeClient, join_keys, key_bytes
from kvpool.client._options import BUSY_POLL_US, SHM_PUT_MIN_BYTES
from kvpool.client._plans import rows_blob
from kvpool.client._shm_path import TOUCH_DELAY_S, ShmPath
from kvpool.client.transport import Transport
from kvpool.placement.cluster_map import ClusterMap
from kvpool.protocol.envelope import ZERO_FINGERPRINT
from kvpool.protocol.errors import Status
from kvpool.protocol.frames import KEY_SIZE, Op, tier_names
from kvpool.protocol.parsers import Segments

__all__ = ["Client"]

T = TypeVar("T")
R = TypeVar("R")


def _oks(statuses: list[int]) -> list[bool]:
    return [s == Status.OK for s in statuses]


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class Client:
    """Blocking client of one kvpool node or a cluster; see :class:`AsyncClient`."""

    def __init__(self, url: str | Sequence[str] | None = None, *,
                 pool_size: int = 2, timeout: float = 10.0, connect_timeout: float = 5.0,
                 client_name: str = "kvpool-python",
                 tracer_provider: TracerProvider | None = None,
                 shm: bool | None = None, token: str | None = None, scope: str = "tenant",
                 ssl: ssl_module.SSLContext | None = None,
                 shm_put_min_bytes: int = SHM_PUT_MIN_BYTES, shm_index: bool = True,
                 transport: Transport | None = None, busy_poll_us: float = BUSY_POLL_US,
                 blocking: bool = True) -> None:
        """:class:`AsyncClient`'s arguments, plus ``blocking``: calls to a standalone node
        that go over TCP run in the calling thread on a socket of this client's own (the
        default; ~30 us a call less here); False runs them on the loop like every other
        call. ``busy_poll_us`` (default 100): how long such a call polls its socket for the
        reply before the thread sleeps; a reply that comes meanwhile needs no wake-up
        (~25 us less a small call on the 2-core VM; at most that much CPU more a call;
        0: sleep at once)."""
        self._async = AsyncClient(url, pool_size=pool_size, timeout=timeout,
                                  connect_timeout=connect_timeout, client_name=client_name,
                                  tracer_provider=tracer_provider, shm=shm, token=token,
                                  scope=scope, ssl=ssl, shm_put_min_bytes=shm_put_min_bytes,
                                  shm_index=shm_index, transport=transport,
                                  busy_poll_us=busy_poll_us)
        self._blocking_allowed = blocking
        self._loop = _new_loop()
        self._lock = threading.Lock()
        #: until when (monotonic) reads through the index may skip the loop
        self._loop_until = 0.0
        #: the blocking TCP path to each node, by node id (made on first use)
        self._blocking: dict[str, BlockingNode] = {}

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            if self._loop.is_closed():
                coro.close()
                raise RuntimeError("this kvpool Client is closed")
            try:
                return self._loop.run_until_complete(coro)
            finally:
                self._loop_until = time.monotonic() + TOUCH_DELAY_S

    @property
    def async_client(self) -> AsyncClient:
        """The async core this facade drives (for SDK extensions such as ``kvpool.gpu``)."""
        return self._async

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of :attr:`async_client` to completion on this client's loop."""
        return self._run(coro)

    @property
    def server_info(self) -> dict[str, Any]:
        return self._async.server_info

    @property
    def num_corrupt(self) -> int:
        return self._async.num_corrupt

    @property
    def num_left_behind(self) -> int:
        """:attr:`AsyncClient.num_left_behind`."""
        return self._async.num_left_behind

    @property
    def bytes_by_path(self) -> dict[str, int]:
        """Payload bytes GETs received through shared memory ("shm") and over TCP ("tcp")."""
        return self._async.bytes_by_path

    @property
    def put_bytes_by_path(self) -> dict[str, int]:
        """Payload bytes PUTs stored through shared memory ("shm") and over TCP ("tcp")."""
        return self._async.put_bytes_by_path

    @property
    def map(self) -> ClusterMap | None:
        """The map this client routes by (see :attr:`AsyncClient.map`)."""
        return self._async.map

    @property
    def epoch(self) -> int:
        """The cluster-map epoch this client routes by (0 = standalone node)."""
        return self._async.epoch

    def connect(self) -> None:
        self._run(self._async.connect())

    def close(self) -> None:
        for driver in self._blocking.values():
            driver.close()
        self._blocking.clear()
        if not self._loop.is_closed():
            self._run(self._async.close())
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    def __enter__(self) -> Client:
        self.connect()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _direct(self, plan_for: Callable[[NodeClient], plans.Plan[T] | None]
                ) -> tuple[T] | None:
        """Run the plan ``plan_for`` makes for a standalone node on the blocking TCP path,
        in this thread with no event loop (:mod:`kvpool.client._blocking`): ``(result,)``.
        None, having sent nothing, where the call runs on the loop instead: not yet
        connected, a cluster, client spans to record, or ``plan_for`` returned None (the
        call goes through shared memory)."""
        with self._lock:
            if self._loop.is_closed():
                raise RuntimeError("this kvpool Client is closed")
            node = self._async.direct_node if self._blocking_allowed else None
            if node is None:
                return None
            plan = plan_for(node)
            if plan is None:
                return None
            return (self._blocking_node(node).run(plan),)

    def _blocking_node(self, node: NodeClient) -> BlockingNode:
        """The blocking driver for ``node`` (a new one after a reconnect or a new map made
        a new NodeClient; drivers of nodes that left the map are closed then)."""
        driver = self._blocking.get(node.node_id)
        if driver is None or driver.node is not node:
            current = {id(n) for n in self._async._node_clients()}
            for node_id, old in list(self._blocking.items()):
                if node_id == node.node_id or id(old.node) not in current:
                    old.close()
                    del self._blocking[node_id]
            driver = self._blocking[node.node_id] = BlockingNode(node)
        return driver

    def _cluster_codes(self, blob: bytes) -> bytes | None:
        """``exists_codes`` against a cluster in this thread, with no event loop: the one
        round of EXISTS frames the loop's fan-out would send (``Router.one_round``; on a
        small cluster, the whole batch to every node), each sent before any reply is
        read (``run_parallel``), with no client spans to record. As on the loop, a node
        that fails is marked down, and each key's answer is the fastest tier the nodes
        that answered for it gave (``codes_of_round``). None, where the call runs on the
        loop instead: a map that round does not cover (one node, a node down, suspect or
        draining), a node this client has no connection to yet (opening a blocking one
        here would wait for its HELLO; the loop's settles without a hung node), a key no
        node answered for (the loop raises the error), or WRONG_OWNER (the loop
        refreshes the map and asks again). A reply from a newer map
        epoch refreshes the map on the loop after the call."""
        with self._lock:
            if self._loop.is_closed():
                raise RuntimeError("this kvpool Client is closed")
            asked = self._async.one_round(blob) if self._blocking_allowed else None
            if asked is None:
                return None
            drivers = [self._blocking_node(node) for node, _ in asked]
            if not all(d.linked or d.node.connections() for d in drivers):
                return None  # a node met on no connection yet: the loop connects to it
            outcomes = run_parallel([(driver, plans.exists(node, rows_blob(blob, rows)))
                                     for driver, (node, rows) in zip(drivers, asked, strict=True)],
                                    settle=[rows for _, rows in asked],
                                    rule=self._async.settle_rule())
            codes = cluster_ops.codes_of_round(len(blob) // KEY_SIZE, asked, outcomes)
            newer = self._async._newer_epoch_seen()
        if newer:
            self._run(self._async._refresh_map(newer))
        return codes

    def put(self, key: Key, value: BufferOrSegments, *, ttl: float | None = None, pin: bool = False,
            chunk_index: int = 0, num_tokens: int = 0,
            fingerprint: bytes = ZERO_FINGERPRINT, parent: Key | None = None) -> None:
        self.put_many([key], [value], ttl=ttl, pin=pin, chunk_indexes=[chunk_index],
                      num_tokens=num_tokens, fingerprint=fingerprint,
                      parents=[parent] if parent is not None else None)

    def put_many(self, keys: Sequence[Key], values: Sequence[BufferOrSegments], *,
                 ttl: float | None = None, pin: bool = False,
                 chunk_indexes: Sequence[int] | None = None, num_tokens: int = 0,
                 fingerprint: bytes = ZERO_FINGERPRINT,
                 parents: Sequence[Key | None] | None = None) -> None:
        bkeys, bparents, ttl_ms, flags = put_args(keys, values, ttl=ttl, pin=pin,
                                                  chunk_indexes=chunk_indexes,
                                                  num_tokens=num_tokens, parents=parents)

        def plan_for(node: NodeClient) -> plans.Plan[list[int]] | None:
            items = plans.put_items(node, bkeys, values, ttl_ms=ttl_ms, flags=flags,
                                    chunk_indexes=chunk_indexes, parents=bparents)
            # through the arena where the blocking link was granted it, else over TCP
            return node.shm_path.put_plan(self._blocking_node(node), items,
                                          num_tokens=num_tokens, fingerprint=fingerprint)

        done = self._direct(plan_for)
        if done is None:
            self._run(self._async.put_many(keys, values, ttl=ttl, pin=pin,
                                           chunk_indexes=chunk_indexes, num_tokens=num_tokens,
                                           fingerprint=fingerprint, parents=parents))
            return
        raise_put_errors(bkeys, done[0], [s == Status.OK for s in done[0]])

    def get(self, key: Key) -> bytearray | None:
        done = self._get((key,), None)
        if done is None:
            return self._run(self._async.get_many((key,)))[0]
        return _bytearrays(done)[0]

    def get_into(self, key: Key, buffer: BufferOrSegments) -> int | None:
        done = self._get((key,), (buffer,))
        if done is None:
            return self._run(self._async.get_many_into((key,), (buffer,)))[0]
        return len(done[0]) if done[0] is not None else None

    def read_in_place(self, key: Key, consume: Callable[[memoryview], None]) -> bool:
        """:meth:`AsyncClient.read_in_place`: ``consume`` runs in this thread."""
        with self._lock:
            if self._loop.is_closed():
                raise RuntimeError("this kvpool Client is closed")
            node = self._async.direct_node
            if node is None or not node.shm_path.can_read_local:
                return False
            self._before_index_read(node.shm_path)
            return self._async.read_in_place(key, consume)

    def _before_index_read(self, shm: ShmPath) -> None:
        """Run the loop if it has not run for a while, or reads wait to be reported: it
        sends them, and hears of connections that ended meanwhile (a node that went
        away), after which the index is not read."""
        if shm.touch_due or time.monotonic() >= self._loop_until:
            self._loop.run_until_complete(self._async.send_touches())
            self._loop_until = time.monotonic() + TOUCH_DELAY_S

    def get_many(self, keys: Sequence[Key]) -> list[bytearray | None]:
        done = self._get(keys, None)
        return _bytearrays(done) if done is not None else self._run(self._async.get_many(keys))

    def get_many_into(self, keys: Sequence[Key], buffers: Sequence[BufferOrSegments]
                      ) -> list[int | None]:
        done = self._get(keys, buffers)
        if done is None:
            return self._run(self._async.get_many_into(keys, buffers))
        return [len(r) if r is not None else None for r in done]

    def _get(self, keys: Sequence[Key], buffers: Sequence[BufferOrSegments] | None
             ) -> list[memoryview | Segments | None] | None:
        """A GET with no event loop, the path decided here once: the standalone node's arena
        index if it holds every key; else, where the node's GETs go over TCP, its blocking
        socket; on a cluster, :meth:`_cluster_read` first. None, having sent nothing: run the call
        on the loop (spans to record, GET_SHM for keys the index lacks, or not yet
        connected)."""
        with self._lock:
            if self._loop.is_closed():
                raise RuntimeError("this kvpool Client is closed")
            blob = join_keys(keys)
            sinks = _sinks(keys, buffers) if buffers is not None else None
            node = self._async.direct_node
            if node is None:
                first = self._cluster_read(blob, sinks)
            else:
                return self._direct_get(node, blob, sinks)
        if first is None:
            return None
        results, missing, newer = first
        if newer:
            self._run(self._async._refresh_map(newer))
        if missing:  # misses, corrupt chunks, nodes that failed: the loop's read goes on
            rest = [sinks[i] for i in missing] if sinks is not None else None
            views = self._run(self._async._get(rows_blob(blob, missing), rest))
            for row, view in zip(missing, views, strict=True):
                results[row] = view
        return results

    def _cluster_read(self, blob: bytes, sinks: Sequence[memoryview | Segments] | None
                      ) -> tuple[list[memoryview | Segments | None], list[int], int] | None:
        """A cluster's GET, its first round in this thread with no event loop: each key to
        the first trusted node of its list (``Router.read_round``), every frame sent before
        any reply is read (``run_parallel``). The payloads (None where not found there), the
        rows still to look for further down their lists (on the loop: misses, corrupt
        chunks, and the keys of a node that failed, which is marked down, or answered
        WRONG_OWNER), and a newer map epoch a reply named (0: none). None, having sent
        nothing, where the read runs on the loop from the start: a map that round does not
        cover (one node, a node draining, a key with no trusted node), client spans to
        record, a node met on no connection yet, or a node whose arena this client mapped
        (its GETs go through it)."""
        asked = self._async.read_round(blob) if self._blocking_allowed else None
        if asked is None or any(node.shm_path.mapping is not None for node, _ in asked):
            return None
        drivers = [self._blocking_node(node) for node, _ in asked]
        if not all(d.linked or d.node.connections() for d in drivers):
            return None
        outcomes = run_parallel([
            (driver, plans.get_tcp(node, rows_blob(blob, rows),
                                   [sinks[i] for i in rows] if sinks is not None else None))
            for driver, (node, rows) in zip(drivers, asked, strict=True)])
        results: list[memoryview | Segments | None] = [None] * (len(blob) // KEY_SIZE)
        answers, _ = cluster_ops.round_answers(asked, outcomes)  # (refused: rows stay None)
        for rows, views in answers:
            for row, view in zip(rows.tolist(), views, strict=True):
                results[row] = view
        missing = [row for row, view in enumerate(results) if view is None]
        return results, missing, self._async._newer_epoch_seen()

    def _direct_get(self, node: NodeClient, blob: bytes,
                    sinks: Sequence[memoryview | Segments] | None
                    ) -> list[memoryview | Segments | None] | None:
        """:meth:`_get` from the standalone ``node`` (the caller holds the lock)."""
        shm = node.shm_path
        if shm.mapping is not None:  # a same-host node granted its arena
            if shm.can_read_local:
                self._before_index_read(shm)
                if shm.can_read_local:
                    found = shm.read_local(blob, sinks)
                    if found is not None:
                        return found
            if shm.carries_gets:
                return None
        if not self._blocking_allowed:
            return None
        return self._blocking_node(node).get(blob, sinks)

    def _either(self, plan_for: Callable[[NodeClient], plans.Plan[T] | None],
                post: Callable[[T], R], coro: Callable[[], Coroutine[Any, Any, R]]) -> R:
        """``post`` of the blocking path's result, or else ``coro()`` run on the loop (the
        async twin of the call: the same checks, errors and spans)."""
        done = self._direct(plan_for)
        return post(done[0]) if done is not None else self._run(coro())

    def exists(self, key: Key) -> bool:
        return self.exists_many([key])[0]

    def exists_many(self, keys: Sequence[Key]) -> list[bool]:
        return self._exists(join_keys(keys), lambda codes: list(map(bool, codes)),
                            lambda: self._async.exists_many(keys))

    def exists_tiers(self, keys: Sequence[Key]) -> list[str | None]:
        return self._exists(join_keys(keys), tier_names, lambda: self._async.exists_tiers(keys))

    def exists_codes(self, keys: bytes | Sequence[Key]) -> bytes:
        blob = keys if isinstance(keys, bytes) else join_keys(keys)
        return self._exists(blob, lambda codes: codes, lambda: self._async.exists_codes(blob))

    def _exists(self, blob: bytes, post: Callable[[bytes], R],
                coro: Callable[[], Coroutine[Any, Any, R]]) -> R:
        """``post`` of the keys' EXISTS codes: from a cluster or a standalone node with no
        event loop where it can, else ``coro()`` on the loop."""
        codes = self._cluster_codes(blob)
        if codes is not None:
            return post(codes)
        return self._either(lambda node: plans.exists(node, blob), post, coro)

    def delete(self, key: Key) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: Sequence[Key]) -> list[bool]:
        blob = join_keys(keys)
        return self._either(lambda node: plans.statuses(node, Op.DELETE, blob), _oks,
                            lambda: self._async.delete_many(keys))

    def lookup(self, keys: Sequence[Key]) -> int:
        return len(self.lookup_tiers(keys))

    def lookup_tiers(self, keys: Sequence[Key]) -> list[str]:
        blob = join_keys(keys)
        codes = self._cluster_codes(blob)
        if codes is not None:
            return cast(list[str], tier_names(cluster_ops.held_prefix(codes)))
        return self._either(lambda node: plans.lookup(node, blob),
                            lambda codes: cast(list[str], tier_names(codes)),
                            lambda: self._async.lookup_tiers(keys))

    def pin(self, key: Key) -> bool:
        blob = key_bytes(key)
        return self._either(lambda node: plans.statuses(node, Op.PIN, blob),
                            lambda statuses: _oks(statuses)[0], lambda: self._async.pin(key))

    def unpin(self, key: Key) -> bool:
        blob = key_bytes(key)
        return self._either(lambda node: plans.statuses(node, Op.UNPIN, blob),
                            lambda statuses: _oks(statuses)[0], lambda: self._async.unpin(key))

    def stats(self) -> dict[str, Any]:
        return self._run(self._async.stats())

    def cluster_map(self) -> dict[str, Any]:
        return self._run(self._async.cluster_map())
