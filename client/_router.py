"""Routing: the map, a ``NodeClient`` per node of it, and the fan-out of a batch.

:class:`Router` holds the map a client routes by and one :class:`NodeClient`
per node; :meth:`Router.fan_out` sends each key of a batch to nodes of its
preference list (``kvpool.client._routing.pick`` chooses which), marks failing
nodes down, and refreshes the map on WRONG_OWNER or on a reply from a newer
epoch (one refresh at a time). The ops that use it (``kvpool.client._cluster_ops``)
say what to send and how to merge answers.

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
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from kvpool.client._checks import checked_map
from kvpool.client._node import NodeClient
from kvpool.client._options import ClientOptions
from kvpool.client._plans import routed_by, rows_blob
from kvpool.client._routing import (
    FIRST_ANSWER,
    Coverage,
    LeftBehind,
    Settle,
    grace,
    pick,
    pick_live,
)
from kvpool.placement.cluster_map import ClusterMap, NodeState
from kvpool.placement.ring import key_positions
from kvpool.protocol.errors import KvpoolConnectionError, WrongOwnerError
from kvpool.protocol.frames import KEY_SIZE, Op

__all__ = ["Router"]

log = logging.getLogger("kvpool.client")
T = TypeVar("T")

#: map refreshes a single call may wait for before giving up on WRONG_OWNER
_MAX_REFRESHES = 3
_CLUSTER_FIELDS = ("epoch", "replication", "fallbacks", "nodes")


class Router:
    """The cluster map and its nodes' clients; install one with :meth:`install`."""

    def __init__(self, options: ClientOptions) -> None:
        self.options = options
        self.map: ClusterMap | None = None
        self.nodes: dict[str, NodeClient] = {}
        #: ``nodes`` in ring order (the map's node indexes)
        self.ring_nodes: list[NodeClient] = []
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

    async def fan_out(self, blob: bytes, send: Send[T], absorb: Absorb[T], *, per_row: str,
                      sequential: bool = False) -> None:
        """Send each key to nodes of its preference list and hand every answer to ``absorb``.

        ``send(node, rows)`` asks one node about the keys at batch positions
        ``rows``; ``absorb(rows, answer)`` takes its answer and may return a
        mask of keys that need no more answers (a GET hit). ``per_row``: how
        many nodes answer for a key ("owners": the replication factor; "all":
        the whole list, at once; "live": the list's live nodes at once, a node
        marked down only where none of it is live (a probe), and a key is done
        once a node answered: a question that must not wait on a hung node
        each time, EXISTS). ``sequential`` asks one node per key per
        round (reads stop at the first hit); otherwise all the nodes still
        needed are asked at once. Nodes that fail are marked down and the key
        moves on down its list; WRONG_OWNER refreshes the map and starts over
        the keys not done. Raises KvpoolConnectionError for keys no node
        answered for (the node's own error where one node's failure is all
        there is to say, as for a standalone node).
        """
        n = len(blob) // KEY_SIZE
        state = _FanOut(send, absorb, np.zeros(n, dtype=np.intp), np.zeros(n, dtype=bool), {},
                        self._background)
        positions: npt.NDArray[np.uint64] | None = None
        refreshes = 0
        while True:
            # the map may be replaced while this call waits: route by one snapshot of it
            cmap, ring_nodes = self.map, self.ring_nodes
            assert cmap is not None
            if len(ring_nodes) == 1:  # every key's list is that node: nothing to look up
                stale = await state.deliver(cmap.epoch, ring_nodes,
                                            [np.flatnonzero(~state.done)], count=1)
            elif per_row != "owners" and not sequential and cmap.width == len(ring_nodes):
                # every key's list is every node (a small cluster) and all of it is asked at
                # once: what ``rounds`` would send, with no ring lookup or picks (~0.15 ms
                # of a 512-key lookup on 3 nodes here)
                rows = np.flatnonzero(~state.done)
                asked = live_or_all(ring_nodes) if per_row == "live" else ring_nodes
                stale = await state.deliver(cmap.epoch, asked, [rows] * len(asked),
                                            count=answers_needed(per_row, cmap),
                                            settle=settling(cmap, ring_nodes)
                                            if per_row == "live" else None)
            else:
                if positions is None:
                    positions = key_positions(blob)
                stale = await state.rounds(cmap, ring_nodes, positions, per_row=per_row,
                                           sequential=sequential)
            if stale is None or refreshes >= _MAX_REFRESHES:
                break
            refreshes += 1
            await self.refresh(min_epoch=stale)
        unanswered = np.flatnonzero(state.answered == 0)
        if len(unanswered):
            if len(state.failed) == 1 and stale is None:  # one node's failure says it all
                raise next(iter(state.failed.values()))
            raise KvpoolConnectionError(
                f"no node of the preference list answered for {len(unanswered)} of {n} keys "
                f"(e.g. {rows_blob(blob, unanswered[:1]).hex()}); "
                f"nodes down: {[x.node_id for x in ring_nodes if not x.live]}")

    def draining(self) -> list[NodeClient]:
        """Live nodes the map marks draining: they own nothing but may still hold chunks."""
        cmap = self.map
        if cmap is None:
            return []
        return [self.nodes[n.id] for n in cmap.nodes
                if n.state == NodeState.DRAINING and self.nodes[n.id].live]

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
        self.standalone_node = self.ring_nodes[0] if cmap.is_standalone else None
        if cmap.is_standalone:
            log.info("kvpool: standalone node %s at %s", cmap.nodes[0].id, cmap.nodes[0].data)
        else:
            log.info("kvpool cluster map epoch %d: %d nodes, replication %d", cmap.epoch,
                     len(cmap.nodes), cmap.replication)

    def read_round(self, blob: bytes) -> list[tuple[NodeClient, Rows]] | None:
        """What :meth:`fan_out`'s first round of a read sends (``sequential``: each key to
        the first trusted node of its list), for a caller that sends it itself (the sync
        client's blocking GET): each node with the batch positions of its keys. None unless
        that round is plain: a map of two or more nodes, none draining, and a trusted node
        in every key's list (else the fan-out probes a node, on the loop)."""
        cmap, ring = self.map, self.ring_nodes
        if cmap is None or len(ring) < 2 or self.draining():
            return None
        n = len(blob) // KEY_SIZE
        table = cmap.ring.owner_indexes(key_positions(blob), cmap.width)
        trusted = np.array([node.trusted for node in ring], dtype=bool)
        picks = pick(table, np.zeros(table.shape, dtype=bool), trusted,
                     np.arange(n, dtype=np.intp))
        asked = [(ring[p.node], p.rows) for p in picks]
        if not asked or not all(trusted[p.node] for p in picks):
            return None
        return asked

    def settle_rule(self) -> Settle:
        """What settles a key of an EXISTS on the map routed by now (:func:`settling`)."""
        return settling(self.map, self.ring_nodes) if self.map is not None else FIRST_ANSWER

    def one_round(self, blob: bytes) -> list[tuple[NodeClient, Rows]] | None:
        """What :meth:`fan_out` with ``per_row="live"`` sends (the live nodes of each key's
        list, at once: EXISTS), for a caller that sends it itself (the sync client's
        blocking fan-out): each node with the batch positions of the keys it is asked
        about. Where every key's list is every node, that is every live node and the whole
        batch; else the picks of the fan-out's first round. None unless that round is all
        there is to it: a map of two or more nodes, none draining, a live node in every
        key's list (else the fan-out probes a node marked down), and none of them
        :attr:`~kvpool.client._node.NodeClient.suspect` (its back-off over, a node that
        fell silent is probed on the loop, where its reconnect and HELLO settle with the
        request; a blocking reconnect would wait out its timeout)."""
        cmap, ring = self.map, self.ring_nodes
        if cmap is None or len(ring) < 2 or self.draining():
            return None
        n = len(blob) // KEY_SIZE
        if cmap.width == len(ring):  # every key's list is every node: no ring lookup
            everything = np.arange(n, dtype=np.intp)
            asked = [(node, everything) for node in ring if node.live]
        else:
            table = cmap.ring.owner_indexes(key_positions(blob), cmap.width)
            picks = pick_live(table, np.zeros(table.shape, dtype=bool),
                              np.array([node.live for node in ring], dtype=bool),
                              np.arange(n, dtype=np.intp))
            asked = [(ring[p.node], p.rows) for p in picks]
        if not asked or any(not node.live or node.suspect for node, _ in asked):
            return None
        return asked

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
Absorb = Callable[[Rows, T], "npt.NDArray[np.bool_] | None"]


def answers_needed(per_row: str, cmap: ClusterMap) -> int:
    """How many nodes must answer for a key before a fan-out of ``per_row`` is done with
    it: every node of its list ("all"), one ("live": all the live ones were asked at
    once), or its owners ("owners")."""
    return {"all": cmap.width, "live": 1}.get(per_row, cmap.num_owners)


def settling(cmap: ClusterMap, ring_nodes: list[NodeClient]) -> Settle:
    """What settles a key of an EXISTS or lookup on ``cmap``: an answer from one of its
    owners at least (:meth:`Settle.for_map`), one node of its list allowed to be silent
    while every node of the map is trusted."""
    return Settle.for_map(cmap.width, cmap.num_owners,
                          healthy=all(node.trusted for node in ring_nodes))


def live_or_all(nodes: list[NodeClient]) -> list[NodeClient]:
    """The live ones of ``nodes``; all of them where none is (probes)."""
    return [node for node in nodes if node.live] or nodes


@dataclass
class _FanOut(Generic[T]):
    """One fan-out: what it sends, what takes the answers, and what it has heard so far."""

    send: Send[T]
    absorb: Absorb[T]
    answered: Rows  #: answers per key
    done: npt.NDArray[np.bool_]  #: keys that need no more answers
    failed: dict[str, KvpoolConnectionError]  #: by node id, the last failure
    background: set[asyncio.Future[Any]]  #: where stragglers' requests are kept (the router's)

    async def rounds(self, cmap: ClusterMap, ring_nodes: list[NodeClient],
                     positions: npt.NDArray[np.uint64], *, per_row: str, sequential: bool
                     ) -> int | None:
        """Ask nodes down each key's preference list, a round at a time, until every key
        has its answers or its list is spent; the newest epoch a WRONG_OWNER named."""
        table = cmap.ring.owner_indexes(positions, cmap.width)
        tried = np.zeros(table.shape, dtype=bool)
        width = table.shape[1]
        count = answers_needed(per_row, cmap)
        for _ in range(width):
            rows = np.flatnonzero(~self.done & ~tried.all(axis=1))
            if not len(rows):
                break
            # a read or a write waits for its nodes: one that let a deadline pass or fell
            # behind is left to the questions that do not (EXISTS settles without it)
            live = np.array([node.live if per_row == "live" else node.trusted
                             for node in ring_nodes], dtype=bool)
            if sequential:
                picks = pick(table, tried, live, rows)
            elif per_row == "live":
                picks = pick_live(table, tried, live, rows)
            else:
                # ask as many more nodes as are still needed, one frame a node
                picks = pick(table, tried, live, rows, per_row=count - self.answered[rows])
            if not picks:
                break
            stale = await self.deliver(cmap.epoch, [ring_nodes[p.node] for p in picks],
                                       [p.rows for p in picks], count=count,
                                       settle=settling(cmap, ring_nodes)
                                       if per_row == "live" else None)
            if stale is not None:
                return stale
        return None

    async def deliver(self, epoch: int, nodes: list[NodeClient], rows: list[Rows], *,
                      count: int, settle: Settle | None = None) -> int | None:
        """Send each node its rows (in parallel), absorb the answers, mark failing nodes
        down; keys with ``count`` answers are done. ``settle``: stop waiting for
        stragglers once each key has those answers (:func:`gather_settled`). The newest
        epoch a WRONG_OWNER named."""
        # the frames say which map routed them, even if a newer one is installed before
        # they are sent (the tasks gather makes copy this context)
        token = routed_by.set(epoch)
        try:
            if len(nodes) == 1:  # awaited in this task: a task of its own costs loop turns
                try:
                    outcomes: list[T | BaseException] = [await self.send(nodes[0], rows[0])]
                except Exception as exc:  # handed on as gather would
                    outcomes = [exc]
            elif settle is not None:
                outcomes = await gather_settled(nodes, rows, self.send, self.background,
                                                settle)
            else:
                outcomes = list(await asyncio.gather(
                    *(self.send(node, r) for node, r in zip(nodes, rows, strict=True)),
                    return_exceptions=True))
        finally:
            routed_by.reset(token)
        stale: int | None = None
        for node, r, outcome in zip(nodes, rows, outcomes, strict=True):
            if isinstance(outcome, LeftBehind):  # a straggler (marked slow)
                continue
            if isinstance(outcome, WrongOwnerError):
                stale = max(stale or 0, outcome.epoch)
                continue
            if isinstance(outcome, KvpoolConnectionError):
                node.mark_down(outcome)
                self.failed[node.node_id] = outcome
                continue
            if isinstance(outcome, BaseException):
                raise outcome
            finished = self.absorb(r, outcome)
            self.answered[r] += 1
            if finished is not None:
                self.done[r[finished]] = True
        self.done |= self.answered >= count
        return stale
