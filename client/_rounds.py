"""Routing rounds as plans: which nodes a cluster op asks, round by round, and how their
answers combine, with no I/O.

A fan-out (:func:`fan_out`) yields a :class:`Round` at a time (each node asked and the
batch positions of its keys; the map epoch that routed them; whether the round settles
without its stragglers) and is sent back each node's outcome, in order: its answer, or
the exception it failed with (``LeftBehind`` for a straggler). It yields
:class:`Refresh` where a node answered WRONG_OWNER: the driver fetches the map, and the
fan-out routes the keys not done by the new one. Two drivers run these plans: the
loop's (:meth:`kvpool.client._router.Router.drive`, the node clients' async calls) and
the sync client's blocking one (``client/_loop_free.py``: the op plans on blocking links,
every frame of a round sent before any reply is read), which hands a plan to the loop's
driver at the first round it cannot send itself. So a cluster op (GET, EXISTS, put,
DELETE, PIN, UNPIN) is routed in one place, whichever driver runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from kvpool.client._node import NodeClient
from kvpool.client._plans import rows_blob
from kvpool.client._routing import LeftBehind, Settle, pick, pick_live
from kvpool.placement.cluster_map import ClusterMap
from kvpool.placement.ring import key_positions
from kvpool.protocol.errors import KvpoolConnectionError, WrongOwnerError
from kvpool.protocol.frames import KEY_SIZE

__all__ = ["Refresh", "Round", "RoundPlan", "Routes", "fan_out", "settling"]

T = TypeVar("T")
R = TypeVar("R")

Rows = npt.NDArray[np.intp]
Absorb = Callable[[Rows, T], "npt.NDArray[np.bool_] | None"]

#: map refreshes a single call may wait for before giving up on WRONG_OWNER
MAX_REFRESHES = 3


class Round(NamedTuple):
    """One round of a fan-out: each node asked with the batch positions of its keys."""

    #: the map epoch that routed it (its frames carry it)
    epoch: int
    asked: list[tuple[NodeClient, Rows]]
    #: settle without stragglers once every key has these answers (None: wait for all)
    settle: Settle | None


class Refresh(NamedTuple):
    """Fetch the map (a node named epoch ``epoch`` in WRONG_OWNER), then go on."""

    epoch: int


#: what a round plan is sent back: one outcome a node asked, in order (none for Refresh)
Outcomes = list["object | BaseException"]
RoundPlan = Generator[Round | Refresh, Outcomes | None, R]


class Routes(Protocol):
    """What a fan-out reads of the router, afresh at each round (a map may be installed
    meanwhile)."""

    map: ClusterMap | None
    ring_nodes: list[NodeClient]

    def draining(self) -> list[NodeClient]: ...


def fan_out(routes: Routes, blob: bytes, absorb: Absorb[T], *, per_row: str,
            sequential: bool = False) -> RoundPlan[None]:
    """Send each key to nodes of its preference list and hand every answer to ``absorb``.

    ``absorb(rows, answer)`` takes one node's answer for the keys at batch positions
    ``rows`` and may return a mask of keys that need no more answers (a GET hit).
    ``per_row``: how many nodes answer for a key ("owners": the replication factor;
    "all": the whole list, at once; "live": the list's live nodes at once, a node marked
    down only where none of it is live (a probe), and a key is done once a node answered:
    a question that must not wait on a hung node each time, EXISTS). ``sequential`` asks
    one node per key per round (reads stop at the first hit); otherwise all the nodes
    still needed are asked at once. Nodes that fail are marked down and the key moves on
    down its list; WRONG_OWNER refreshes the map and starts over the keys not done.
    Raises KvpoolConnectionError for keys no node answered for (the node's own error
    where one node's failure is all there is to say, as for a standalone node).
    """
    n = len(blob) // KEY_SIZE
    state = _FanOut(absorb, np.zeros(n, dtype=np.intp), np.zeros(n, dtype=bool), {})
    positions: npt.NDArray[np.uint64] | None = None
    refreshes = 0
    while True:
        # route by one snapshot of the map, though another may be installed meanwhile
        cmap, ring_nodes = routes.map, routes.ring_nodes
        assert cmap is not None
        if len(ring_nodes) == 1:  # every key's list is that node: nothing to look up
            stale = yield from state.deliver(
                Round(cmap.epoch, [(ring_nodes[0], np.flatnonzero(~state.done))], None),
                count=1)
        elif per_row != "owners" and not sequential and cmap.width == len(ring_nodes):
            # every key's list is every node (a small cluster) and all of it is asked at
            # once: what ``rounds`` would send, with no ring lookup or picks (~0.15 ms of
            # a 512-key lookup on 3 nodes here)
            rows = np.flatnonzero(~state.done) if refreshes else np.arange(n, dtype=np.intp)
            asked = live_or_all(ring_nodes) if per_row == "live" else ring_nodes
            stale = yield from state.deliver(
                Round(cmap.epoch, [(node, rows) for node in asked],
                      settling(cmap, ring_nodes) if per_row == "live" else None),
                count=answers_needed(per_row, cmap))
        else:
            if positions is None:
                positions = key_positions(blob)
            stale = yield from state.rounds(cmap, ring_nodes, positions, per_row=per_row,
                                            sequential=sequential)
        if stale is None or refreshes >= MAX_REFRESHES:
            break
        refreshes += 1
        yield Refresh(stale)
    if not state.answered.all():
        unanswered = np.flatnonzero(state.answered == 0)
        if len(state.failed) == 1 and stale is None:  # one node's failure says it all
            raise next(iter(state.failed.values()))
        raise KvpoolConnectionError(
            f"no node of the preference list answered for {len(unanswered)} of {n} keys "
            f"(e.g. {rows_blob(blob, unanswered[:1]).hex()}); "
            f"nodes down: {[x.node_id for x in ring_nodes if not x.live]}")


def answers_needed(per_row: str, cmap: ClusterMap) -> int:
    """How many nodes must answer for a key before a fan-out of ``per_row`` is done with
    it: every node of its list ("all"), one ("live": all the live ones were asked at
    once), or its owners ("owners")."""
    if per_row == "live":
        return 1
    return cmap.width if per_row == "all" else cmap.num_owners


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
    """One fan-out: what takes the answers, and what it has heard so far."""

    absorb: Absorb[T]
    answered: Rows  #: answers per key
    done: npt.NDArray[np.bool_]  #: keys that need no more answers
    failed: dict[str, KvpoolConnectionError]  #: by node id, the last failure

    def rounds(self, cmap: ClusterMap, ring_nodes: list[NodeClient],
               positions: npt.NDArray[np.uint64], *, per_row: str, sequential: bool
               ) -> Generator[Round, Outcomes | None, int | None]:
        """Ask nodes down each key's preference list, a round at a time, until every key
        has its answers or its list is spent; the newest epoch a WRONG_OWNER named."""
        width = cmap.width
        table = cmap.ring.owner_indexes(positions, width)
        tried = np.zeros(table.shape, dtype=bool)
        count = answers_needed(per_row, cmap)
        for round_no in range(width):
            if round_no == 0 and not self.done.any():  # (most calls: every key to ask)
                rows = np.arange(len(self.done), dtype=np.intp)
            else:
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
            stale = yield from self.deliver(
                Round(cmap.epoch, [(ring_nodes[p.node], p.rows) for p in picks],
                      settling(cmap, ring_nodes) if per_row == "live" else None),
                count=count)
            if stale is not None:
                return stale
            if self.done.all():  # (most calls: one round answered every key)
                break
        return None

    def deliver(self, round_: Round, *, count: int
                ) -> Generator[Round, Outcomes | None, int | None]:
        """Ask the round's nodes, absorb the answers, mark failing nodes down; keys with
        ``count`` answers are done. The newest epoch a WRONG_OWNER named."""
        outcomes = yield round_
        assert outcomes is not None
        stale: int | None = None
        answered, whole = self.answered, len(self.answered)
        for (node, rows), outcome in zip(round_.asked, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if isinstance(outcome, LeftBehind):  # a straggler (marked slow)
                    continue
                if isinstance(outcome, WrongOwnerError):
                    stale = max(stale or 0, outcome.epoch)
                    continue
                if isinstance(outcome, KvpoolConnectionError):
                    node.mark_down(outcome)
                    self.failed[node.node_id] = outcome
                    continue
                raise outcome
            finished = self.absorb(rows, outcome)  # type: ignore[arg-type]
            if len(rows) == whole:  # the whole batch (rows in order): no gather
                answered += 1
            else:
                answered[rows] += 1
            if finished is not None:
                self.done[rows[finished]] = True
        self.done |= self.answered >= count
        return stale


def then_each(nodes: list[NodeClient], missing: Rows,
              absorb: Callable[[Rows, T], npt.NDArray[np.bool_]]) -> RoundPlan[Rows]:
    """Ask ``nodes`` one after another for the ``missing`` rows still missing (a draining
    node may still hold chunks it no longer owns; its frames carry its own epoch, 0 in
    the round); ``absorb`` says which it answered for. A node that fails is marked down
    and passed over. The rows still missing."""
    for node in nodes:
        if not len(missing):
            break
        (outcome,) = yield Round(0, [(node, missing)], None)  # type: ignore[misc]
        if isinstance(outcome, KvpoolConnectionError):
            node.mark_down(outcome)
            continue
        if isinstance(outcome, BaseException):
            raise outcome
        missing = missing[~absorb(missing, outcome)]  # type: ignore[arg-type]
    return missing
