"""Routing: the map, a ``NodeClient`` per node of it, and the fan-out of a batch.

:class:`Router` holds the map a client routes by and one :class:`NodeClient`
per node; :meth:`Router.drive` runs a round plan on the loop (``client/_rounds.py``:
each key of a batch to nodes of its preference list, ``kvpool.client._routing.pick``
choosing which; failing nodes marked down), and refreshes the map on WRONG_OWNER or on
a reply from a newer epoch (one refresh at a time). The ops that use it
(``kvpool.client._cluster_ops``) say what to send and how to merge answers.

A standalone node is routed to like any cluster: by its one-node map of epoch 0
(``ClusterMap.standalone``), which the client makes from the node's HELLO; every
key's preference list is that node. :attr:`Router.standalone_node` names it for the
few things that differ (the sync client's loop-free paths, the shape of ``stats``,
the node's own LOOKUP).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvpool.client._checks import checked_map
from kvpool.client._node import NodeClient
from kvpool.client._options import ClientOptions
from kvpool.client._plans import routed_by
from kvpool.client._rounds import Refresh, Round, RoundPlan
from kvpool.client._routing import FIRST_ANSWER, Coverage, LeftBehind, Settle, grace
from kvpool.placement.cluster_map import ClusterMap, NodeState
from kvpool.protocol.errors import KvpoolConnectionError, WrongOwnerError
from kvpool.protocol.frames import Op

__all__ = ["Router"]

log = logging.getLogger("kvpool.client")
T = TypeVar("T")
R = TypeVar("R")

_CLUSTER_FIELDS = ("epoch", "replication", "fallbacks", "nodes")


class Router:
    """The cluster map and its nodes' clients; install one with :meth:`install`."""

    def __init__(self, options: ClientOptions) -> None:
        self.options = options
        self.map: ClusterMap | None = None
        self.nodes: dict[str, NodeClient] = {}
        #: ``nodes`` in ring order (the map's node indexes)
        self.ring_nodes: list[NodeClient] = []
        #: ``nodes`` the map marks draining
        self._draining: list[NodeClient] = []
        #: the node, when this client routes by a standalone node's map (epoch 0)
        self.standalone_node: NodeClient | None = None
        #: corrupt chunks, and stragglers left behind, counted by node clients no longer
        #: in the map
        self.num_corrupt_gone = 0
        self.left_behind_gone = 0
        self._refreshing: asyncio.Task[None] | None = None
        #: the newest epoch a reply named while no loop ran (0: none): the sync client
        #: refreshes the map on its loop when this is past the map's
        self.newer_epoch = 0
        #: tasks that outlive the call that made them (map refreshes, stragglers' requests):
        #: cancelled on close
        self._background: set[asyncio.Future[Any]] = set()

    def total(self, count: Callable[[NodeClient], int]) -> int:
        """``count`` summed over the nodes this client has a NodeClient for."""
        return sum(count(node) for node in self.nodes.values())

    def by_path(self, counts: Callable[[NodeClient], dict[str, int]]) -> dict[str, int]:
        """Per-path ("shm", "tcp") ``counts`` summed over the nodes."""
        return {path: sum(counts(node)[path] for node in self.nodes.values())
                for path in ("shm", "tcp")}

    def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        for node in self.nodes.values():
            node.close()
            node.path.release()

    async def drive(self, plan: RoundPlan[R], send: Send[Any],
                    pending: Round | Refresh | None = None) -> R:
        """Run a round plan (``client/_rounds.py``) on the loop: each round's nodes asked
        at once with ``send``, the map refreshed where it says. ``pending``: a step the
        plan yielded already (the sync client's driver hands its plan over so)."""
        step = pending
        outcomes: list[Any] | None = None
        while True:
            if step is None:
                try:
                    step = plan.send(outcomes)
                except StopIteration as done:
                    return cast(R, done.value)
            if isinstance(step, Refresh):
                await self.refresh(min_epoch=step.epoch)
                outcomes = None
            else:
                outcomes = await self._ask(step, send)
            step = None

    async def _ask(self, round_: Round, send: Send[T]) -> list[T | BaseException]:
        """Each node of ``round_`` asked its rows at once: its answer or its exception,
        in order (``LeftBehind``: a straggler a settling round stopped waiting for)."""
        # the frames say which map routed them, even if a newer one is installed before
        # they are sent (the tasks gather makes copy this context)
        token = routed_by.set(round_.epoch)
        try:
            if len(round_.asked) == 1:  # awaited in this task: a task costs loop turns
                node, rows = round_.asked[0]
                try:
                    return [await send(node, rows)]
                except Exception as exc:  # handed on as gather would
                    return [exc]
            nodes = [node for node, _ in round_.asked]
            rows_of = [rows for _, rows in round_.asked]
            if round_.settle is not None:
                return await gather_settled(nodes, rows_of, send, self._background,
                                            round_.settle)
            return list(await asyncio.gather(
                *(send(node, rows) for node, rows in round_.asked), return_exceptions=True))
        finally:
            routed_by.reset(token)

    def draining(self) -> list[NodeClient]:
        """Live nodes the map marks draining: they own nothing but may still hold chunks."""
        return [node for node in self._draining if node.live] if self._draining else []

    @property
    def sole_node(self) -> NodeClient | None:
        """The node of a one-node map (a standalone node, or a cluster of one): every
        key's preference list is that node, so a batch goes to it whole."""
        return self.ring_nodes[0] if len(self.nodes) == 1 else None

    async def ask_sole(self, call: Callable[[NodeClient], Awaitable[T]]) -> T | None:
        """``call(node)``'s answer where the map has one node, asked for the whole batch
        with none of :meth:`fan_out`'s numpy (~100 us a call when run cold after a
        wake-up, as every call is). None: fan out instead (the map has more nodes, or
        the node answered WRONG_OWNER and the map was refreshed). A node that fails
        raises its own error; it is not marked down (there is no other node to turn to,
        and that would close its other connections under their requests; the one that
        timed out is already aborted)."""
        node, cmap = self.sole_node, self.map
        if node is None or cmap is None:
            return None
        token = routed_by.set(cmap.epoch)
        try:
            return await call(node)
        except WrongOwnerError as exc:
            stale = exc.epoch
        finally:
            routed_by.reset(token)
        await self.refresh(min_epoch=stale)
        return None


    async def map_from(self, node: NodeClient) -> ClusterMap:
        """The map to route by, from a node that said HELLO: a cluster node's map, or a
        standalone node's own one-node map (at the address this client reached it by)."""
        if node.server_info.get("cluster"):
            return await self.fetch_map(node)
        host = f"[{node.host}]" if ":" in node.host else node.host
        return ClusterMap.standalone(str(node.server_info.get("node_id") or node.node_id),
                                     f"{host}:{node.port}")

    @staticmethod
    async def fetch_map(node: NodeClient) -> ClusterMap:
        return checked_map(node.node_id, await node.json_op(Op.CLUSTER), _CLUSTER_FIELDS)

    def install(self, cmap: ClusterMap, seed: NodeClient | None = None) -> None:
        old = self.nodes
        nodes: dict[str, NodeClient] = {}
        for info in cmap.nodes:
            address = info.data_address
            node = old.get(info.id)
            if node is None or (node.host, node.port) != address:
                if seed is not None and (seed.host, seed.port) == address:
                    node, seed = seed, None
                    node.node_id = info.id
                else:
                    node = NodeClient(*address, self.options, node_id=info.id)
            node.epoch = cmap.epoch
            node.on_newer_epoch = self._on_newer_epoch
            nodes[info.id] = node
        for node_id, node in old.items():
            if nodes.get(node_id) is not node:
                self.num_corrupt_gone += node.num_corrupt
                self.left_behind_gone += node.left_behind
                node.close()
        if seed is not None:
            seed.close()
        self.map = cmap
        self.nodes = nodes
        self.ring_nodes = [nodes[i] for i in cmap.ring.nodes]
        self._draining = [nodes[n.id] for n in cmap.nodes if n.state == NodeState.DRAINING]
        self.standalone_node = self.ring_nodes[0] if cmap.is_standalone else None
        if cmap.is_standalone:
            log.info("kvpool: standalone node %s at %s", cmap.nodes[0].id, cmap.nodes[0].data)
        else:
            log.info("kvpool cluster map epoch %d: %d nodes, replication %d", cmap.epoch,
                     len(cmap.nodes), cmap.replication)

    def _on_newer_epoch(self, epoch: int) -> None:
        if self.map is None or epoch <= self.map.epoch:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a sync call with no loop (the blocking path): refreshed after
            self.newer_epoch = max(self.newer_epoch, epoch)
            return
        if self._refreshing is None:
            task = loop.create_task(self.refresh(min_epoch=epoch))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def refresh(self, min_epoch: int = 0) -> None:
        """Fetch the map from a few live nodes; install the newest one (single-flight)."""
        if self._refreshing is not None:
            await asyncio.shield(self._refreshing)
            return
        self._refreshing = asyncio.get_running_loop().create_task(self._do_refresh(min_epoch))
        try:
            await asyncio.shield(self._refreshing)
        finally:
            self._refreshing = None

    async def _do_refresh(self, min_epoch: int) -> None:
        # trusted nodes first; and the answers settle, as EXISTS's do: a hung node among
        # those asked is left behind, not waited for until the timeout
        nodes = [n for n in self.nodes.values() if n.trusted] or \
            [n for n in self.nodes.values() if n.live]
        random.shuffle(nodes)
        asked = nodes[:3]
        one = np.zeros(1, dtype=np.intp)  # each node is asked the same one question
        maps = await gather_settled(asked, [one] * len(asked),
                                    lambda node, _: self.fetch_map(node),
                                    self._background) if asked else []
        good = [m for m in maps if isinstance(m, ClusterMap)]
        if not good:
            log.warning("kvpool: no node answered a cluster map refresh")
            return
        newest = max(good, key=lambda m: m.epoch)
        if self.map is None or newest.epoch > self.map.epoch:
            self.install(newest)
        elif newest.epoch < min_epoch:
            log.info("kvpool: asked for map epoch >= %d, nodes gave %d", min_epoch,
                     newest.epoch)


async def gather_settled(nodes: list[NodeClient], rows: list[Rows],
                         send: Callable[[NodeClient, Rows], Awaitable[T]],
                         background: set[asyncio.Future[Any]],
                         settle: Settle = FIRST_ANSWER) -> list[T | BaseException]:
    """``send(node, rows)`` to each node at once, as ``gather(return_exceptions=True)``,
    but done once every row has the answers ``settle`` asks for (counting the nodes
    trusted when asked) and the nodes still silent have had
    :func:`~kvpool.client._routing.grace` more: those are marked slow and their outcome is
    a ``LeftBehind``; their requests go on, kept in ``background`` (a late answer still
    brings the node back, a failure marks it down). One done-callback a request and one
    timer, as ``gather`` (``asyncio.wait`` in a loop measured ~12% more client CPU on a
    3-node lookup)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    timeout = nodes[0].options.timeout
    tasks: list[asyncio.Future[T]] = [asyncio.ensure_future(send(node, r))
                                      for node, r in zip(nodes, rows, strict=True)]
    outcomes: list[T | BaseException] = [LeftBehind()] * len(tasks)
    coverage = Coverage(rows, settle, [node.trusted for node in nodes])
    settled: asyncio.Future[None] = loop.create_future()
    left = len(tasks)
    timer: asyncio.TimerHandle | None = None

    def finish() -> None:
        if not settled.done():
            settled.set_result(None)

    def on_done(i: int, task: asyncio.Future[T]) -> None:
        nonlocal left, timer
        if settled.done():
            return
        left -= 1
        outcomes[i] = _outcome(task)
        if isinstance(outcomes[i], BaseException):
            coverage.fail(i)
        else:
            coverage.add(i)
        if not left:
            finish()
        elif timer is None and coverage.full:
            timer = loop.call_later(grace(loop.time() - start, timeout), finish)

    for i, task in enumerate(tasks):
        task.add_done_callback(functools.partial(on_done, i))
    try:
        await settled
    except BaseException:
        for task in tasks:  # cancelled: so is what it waits for, as with gather
            task.cancel()
        raise
    finally:
        if timer is not None:
            timer.cancel()
    for i, task in enumerate(tasks):
        if task.done():  # done as the grace ended, its callback not yet run
            if isinstance(outcomes[i], LeftBehind):
                outcomes[i] = _outcome(task)
        else:
            node = nodes[i]
            node.mark_slow()
            background.add(task)
            task.add_done_callback(background.discard)
            task.add_done_callback(functools.partial(_straggler_done, node))
    return outcomes


def _outcome(task: asyncio.Future[T]) -> T | BaseException:
    """What ``gather(return_exceptions=True)`` gives for a done ``task``."""
    if task.cancelled():
        return asyncio.CancelledError()
    exc = task.exception()
    return exc if exc is not None else task.result()


def _straggler_done(node: NodeClient, task: asyncio.Future[object]) -> None:
    """A straggler's request ended: a failure marks its node down (an answer already
    brought it back, in ``NodeClient.check``)."""
    if task.cancelled():
        return
    exc = task.exception()
    if isinstance(exc, KvpoolConnectionError):
        node.mark_down(exc)


Rows = npt.NDArray[np.intp]
Send = Callable[[NodeClient, Rows], Awaitable[T]]
