"""The sync client's calls that skip its event loop: :class:`LoopFree`.

The sync :class:`~kvpool.client.Client` runs the async core on a loop of its own; it
asks :class:`LoopFree` first, which answers a call here or says to run it on the
loop. Two kinds of call skip the loop (a loop run costs ~40 us here, as much as copying
1 MiB, and more than a small request's round trip):

- a call to a standalone node that goes over TCP (every key op, GETs where the
  node grants no shared memory, puts below ``shm_put_min_bytes``), and a put
  through its arena (``client/_shm_put.py``), runs the
  same op plans as the async core (:mod:`kvpool.client._plans`) on a blocking
  socket of this client's own (:mod:`kvpool.client._blocking`), unless client
  spans are recorded; so a sync client holds one connection more than its
  pool. On a cluster, GET, EXISTS (so lookups), DELETE, PIN, UNPIN and puts below
  ``shm_put_min_bytes`` run their round plans (``client/_rounds.py``, the same the
  loop runs) on the blocking sockets of the nodes asked, every frame of a round sent
  before any reply is read (:func:`~kvpool.client._blocking.run_parallel`), and hand
  the plan to the loop at the first round they cannot send themselves (a node not
  trusted or not yet met, for GETs one whose arena the client mapped, a map refresh).
  A cluster's other calls run on the loop.
- a GET that a same-host node's arena index can answer whole is copied with
  no request at all (``NodePath.get_here``). The loop still runs before such a read
  when the reads before it are due to be reported, or when it has not run for
  ``TOUCH_DELAY_S`` (50 ms): so the client hears of a node that died (its
  connection's end) before reading values frozen in its index.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar, cast

from kvpool.client import _cluster_ops as cluster_ops
from kvpool.client import _plans as plans
from kvpool.client._async import AsyncClient, get_sinks, put_args, raise_put_errors
from kvpool.client._blocking import BlockingNode, run_parallel
from kvpool.client._connection import BufferOrSegments
from kvpool.client._node import Key, NodeClient, join_keys
from kvpool.client._plans import Plan, rows_blob
from kvpool.client._rounds import Refresh, Round, RoundPlan
from kvpool.client._router import Rows, Send
from kvpool.client._routing import FIRST_ANSWER
from kvpool.client._shm_path import TOUCH_DELAY_S
from kvpool.client.paths import NodePath
from kvpool.protocol.errors import Status
from kvpool.protocol.frames import KEY_SIZE, Op
from kvpool.protocol.parsers import Segments

__all__ = ["LoopFree"]

T = TypeVar("T")
R = TypeVar("R")


class LoopFree:
    """The blocking routes of one sync client: the loop it skips (``loop``, run under
    ``lock`` by :meth:`run`), the async core whose nodes and routing it shares (``core``),
    and a blocking driver per node (:class:`~kvpool.client._blocking.BlockingNode`).
    Each route returns None, having sent nothing, where the call runs on the loop."""

    def __init__(self, core: AsyncClient, loop: asyncio.AbstractEventLoop, *,
                 allowed: bool) -> None:
        self.core, self.loop = core, loop
        self.router = core.router
        #: one call at a time, on the loop or off it
        self.lock = threading.Lock()
        #: calls over TCP may run on blocking sockets (``Client(blocking=...)``)
        self.allowed = allowed
        #: until when (monotonic) reads through the index may skip the loop
        self.loop_until = 0.0
        #: the blocking TCP path to each node, by node id (made on first use)
        self.drivers: dict[str, BlockingNode] = {}

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` to completion on the loop, in this thread."""
        with self.lock:
            if self.loop.is_closed():
                coro.close()
                raise RuntimeError("this kvpool Client is closed")
            try:
                return self.loop.run_until_complete(coro)
            finally:
                self.loop_until = time.monotonic() + TOUCH_DELAY_S

    @property
    def direct_node(self) -> NodeClient | None:
        """The standalone node, when a call to it may run in this thread with no event
        loop: no client spans to record. Calls then read through the node's arena index
        (``node.path``) or run the op plans on a blocking connection its transport
        opens (:mod:`kvpool.client._blocking`); which one is the node's to say
        (:attr:`NodePath.carries_gets`, :meth:`NodePath.carries_put`)."""
        node = self.router.standalone_node
        return node if node is not None and not self.core.records_spans else None

    def _spanless(self) -> bool:
        """Calls over TCP may skip the loop now: allowed, and no client spans to record."""
        return self.allowed and not self.core.records_spans

    def _newer_epoch_seen(self) -> int:
        """A map epoch newer than the one the client routes by, named by a reply while no
        loop ran (0: none); :meth:`_refresh_map` fetches it."""
        router = self.router
        if router.map is not None and router.newer_epoch > router.map.epoch:
            return router.newer_epoch
        return 0

    async def _refresh_map(self, min_epoch: int) -> None:
        self.router.newer_epoch = 0  # asked for once, whatever the nodes give
        await self.router.refresh(min_epoch)

    async def _send_touches(self) -> None:
        """Report the reads made through the arena index now (one TOUCH a node), on the
        loop."""
        for node in self.router.nodes.values():
            node.path.touches.later()

    def close(self) -> None:
        for driver in self.drivers.values():
            driver.close()
        self.drivers.clear()

    def _check_open(self) -> None:
        if self.loop.is_closed():
            raise RuntimeError("this kvpool Client is closed")

    def read_in_place(self, key: Key, consume: Callable[[memoryview], None]) -> bool:
        """:meth:`AsyncClient.read_in_place` in this thread (False: not possible here)."""
        with self.lock:
            self._check_open()
            node = self.direct_node
            if node is None or not node.path.can_read_local:
                return False
            self.before_index_read(node.path)
            return self.core.read_in_place(key, consume)

    def direct(self, plan_for: Callable[[NodeClient], plans.Plan[T] | None]
               ) -> tuple[T] | None:
        """Run the plan ``plan_for`` makes for a standalone node on the blocking TCP path,
        in this thread with no event loop (:mod:`kvpool.client._blocking`): ``(result,)``.
        None, having sent nothing, where the call runs on the loop instead: not yet
        connected, a cluster, client spans to record, or ``plan_for`` returned None (the
        call goes through shared memory)."""
        with self.lock:
            self._check_open()
            node = self.direct_node if self.allowed else None
            if node is None:
                return None
            plan = plan_for(node)
            if plan is None:
                return None
            return (self.driver(node).run(plan),)

    def put(self, keys: Sequence[Key], values: Sequence[BufferOrSegments], *,
            ttl: float | None, pin: bool, chunk_indexes: Sequence[int] | None,
            num_tokens: int, fingerprint: bytes, parents: Sequence[Key | None] | None
            ) -> bool:
        """``put_many`` with no event loop: to a standalone node through its arena where
        the blocking link was granted it, else over TCP; to a cluster, its round plan
        (``put_rounds``) by :meth:`_rounds` where the values total less than
        ``shm_put_min_bytes`` (so that no arena would carry them: a blocking round sends
        to one node after another, where the loop interleaves big values). Raises what
        the nodes refused. False, having sent nothing: run it on the loop."""
        bkeys, bparents, ttl_ms, flags = put_args(keys, values, ttl=ttl, pin=pin,
                                                  chunk_indexes=chunk_indexes,
                                                  num_tokens=num_tokens, parents=parents)
        batch = cluster_ops.PutBatch(bkeys, values, ttl_ms, flags, chunk_indexes, num_tokens,
                                     fingerprint, bparents)
        if self._on_cluster():
            if sum(view.nbytes for value in values for view in plans.as_segments(value)) \
                    >= self.core.options.shm_put_min_bytes:
                return False
            refused, stored = self._rounds(
                cluster_ops.put_rounds(self.router, batch),
                lambda node, rows: node.path.put_plan(
                    self.driver(node), batch.part(rows).items(node), num_tokens=num_tokens,
                    fingerprint=fingerprint),
                lambda node, rows: batch.part(rows).put_on(node), reads=False)
            raise_put_errors(bkeys, refused, stored)
            return True

        done = self.direct(lambda node: node.path.put_plan(
            self.driver(node), batch.items(node), num_tokens=num_tokens,
            fingerprint=fingerprint))
        if done is None:
            return False
        raise_put_errors(bkeys, done[0], [s == Status.OK for s in done[0]])
        return True

    def exists(self, blob: bytes) -> bytes | None:
        """The keys' EXISTS codes with no event loop (a cluster's by its round plan,
        ``exists_rounds``); None, having sent nothing: run it on the loop."""
        if self._on_cluster():
            return self._rounds(cluster_ops.exists_rounds(self.router, blob),
                                lambda node, rows: plans.exists(node, rows_blob(blob, rows)),
                                lambda node, rows: node.exists(rows_blob(blob, rows)),
                                reads=False)
        done = self.direct(lambda node: plans.exists(node, blob))
        return done[0] if done is not None else None

    def lookup(self, blob: bytes) -> bytes | None:
        """Tier codes of the leading keys held (a cluster's: its EXISTS up to the first
        key none holds), as :meth:`exists`."""
        if self._on_cluster():
            codes = self.exists(blob)
            return cluster_ops.held_prefix(codes) if codes is not None else None
        done = self.direct(lambda node: plans.lookup(node, blob))
        return bytes(done[0]) if done is not None else None

    def oks(self, op: Op, blob: bytes) -> list[bool] | None:
        """DELETE, PIN or UNPIN with no event loop (a cluster's by its round plan,
        ``statuses_rounds``): whether each was done somewhere; None, having sent nothing:
        run it on the loop."""
        if self._on_cluster():
            return self._rounds(cluster_ops.statuses_rounds(self.router, blob),
                                lambda node, rows: plans.statuses(node, op, rows_blob(blob, rows)),
                                lambda node, rows: node.statuses(op, rows_blob(blob, rows)),
                                reads=False)
        done = self.direct(lambda node: plans.statuses(node, op, blob))
        return [s == Status.OK for s in done[0]] if done is not None else None

    def driver(self, node: NodeClient) -> BlockingNode:
        """The blocking driver for ``node`` (a new one after a reconnect or a new map made
        a new NodeClient; drivers of nodes that left the map are closed then)."""
        driver = self.drivers.get(node.node_id)
        if driver is None or driver.node is not node:
            current = {id(n) for n in self.router.nodes.values()}
            for node_id, old in list(self.drivers.items()):
                if node_id == node.node_id or id(old.node) not in current:
                    old.close()
                    del self.drivers[node_id]
            driver = self.drivers[node.node_id] = BlockingNode(node)
        return driver

    def _rounds(self, plan: RoundPlan[R], node_plan: Callable[[NodeClient, Rows], Plan[Any]],
                send: Send[Any], *, reads: bool) -> R:
        """Run a cluster op's round plan (``client/_rounds.py``) in this thread: each
        round's frames (``node_plan``) on the nodes' blocking links, every frame sent
        before any reply is read (``run_parallel``; a settling round leaves its stragglers
        behind, as on the loop), while a round's nodes are all trusted and met on a
        connection already (a blocking HELLO here would wait out a hung node's timeout;
        the loop's settles without it) and, for ``reads``, none carries GETs through a
        region it granted. From the first round that is not, or a map refresh, the plan
        goes on on the loop (``Router.drive``, with ``send``). A reply from a newer map
        epoch refreshes the map on the loop."""
        step: Round | Refresh | None = None
        outcomes: list[Any] | None = None
        with self.lock:
            self._check_open()
            while True:
                try:
                    step = plan.send(outcomes)
                except StopIteration as done:
                    step, result = None, cast(R, done.value)
                    break
                if isinstance(step, Refresh) or not self._sendable(step, reads=reads):
                    break
                outcomes = cast(list[Any], run_parallel(
                    [(self.driver(node), node_plan(node, rows)) for node, rows in step.asked],
                    settle=[rows for _, rows in step.asked] if step.settle is not None
                    else None, rule=step.settle or FIRST_ANSWER))
            newer = self._newer_epoch_seen()
        if newer:
            self.run(self._refresh_map(newer))
        if step is not None:
            result = self.run(self.router.drive(plan, send, pending=step))
        return result

    def _on_cluster(self) -> bool:
        """A cluster's call may go by :meth:`_rounds`: connected to a cluster (not a
        standalone node), calls over TCP allowed, no client spans to record."""
        return self.router.map is not None and self.router.standalone_node is None \
            and self._spanless()

    def _sendable(self, round_: Round, *, reads: bool) -> bool:
        """Whether :meth:`_rounds` sends ``round_`` itself (see there)."""
        for node, _ in round_.asked:
            if not node.trusted or (reads and node.path.grant is not None):
                return False
            if not (self.driver(node).linked or node.connections()):
                return False  # a node met on no connection yet: the loop connects to it
        return True

    def before_index_read(self, path: NodePath) -> bool:
        """Run the loop if it has not run for a while, or reads wait to be reported: it
        sends them, and hears of connections that ended meanwhile (a node that went
        away), after which the index is not read. Whether it ran."""
        if path.touches.due or time.monotonic() >= self.loop_until:
            self.loop.run_until_complete(self._send_touches())
            self.loop_until = time.monotonic() + TOUCH_DELAY_S
            return True
        return False

    def get(self, keys: Sequence[Key], buffers: Sequence[BufferOrSegments] | None
            ) -> list[memoryview | Segments | None] | None:
        """A GET with no event loop, the path decided here once: the standalone node's arena
        index for the keys it holds, the blocking socket for the rest (misses, values the
        index has no slot for); where the node's GETs go over TCP, its blocking socket; on a
        cluster, its round plan (``get_rounds``) by :meth:`_rounds`. None, having sent
        nothing: run the call on the loop (spans to record, a tenant-scoped connection's
        GET_SHM, or not yet connected)."""
        with self.lock:
            if self.loop.is_closed():  # (_check_open, inlined: every GET asks)
                raise RuntimeError("this kvpool Client is closed")
            blob = join_keys(keys)
            sinks = get_sinks(keys, buffers) if buffers is not None else None
            node = self.router.standalone_node  # (the direct node, as inlined: every GET)
            if node is not None and not self.core.records_spans:
                # the route within the node is its path's (NodePath.get_here)
                return node.path.get_here(blob, sinks,
                                          self.driver(node) if self.allowed else None,
                                          lambda: self.before_index_read(node.path))
        if not self._on_cluster():
            return None
        results: list[memoryview | Segments | None] = [None] * (len(blob) // KEY_SIZE)

        def some(rows: Rows) -> list[memoryview | Segments] | None:
            return [sinks[i] for i in rows] if sinks is not None else None

        self._rounds(cluster_ops.get_rounds(self.router, blob, results),
                     lambda node, rows: plans.get_tcp(node, rows_blob(blob, rows), some(rows)),
                     lambda node, rows: node.get(rows_blob(blob, rows), some(rows)),
                     reads=True)
        return results
