"""Choosing which node gets which keys of a batch. Pure (numpy), no I/O.

Every key of a batch has a preference list: a row of ring node indexes,
owners first, then fallbacks (``ClusterMap.preference``). A *pick* takes,
for each pending row, the first column not tried yet whose node is live,
and groups the picks by node so each node gets one sub-batch. If none of a
row's untried nodes is live, the pick probes the first untried one anyway:
back-off is a hint, and a request to a node thought down is how it comes
back.

A question several nodes are asked at once for the same keys (EXISTS: every live
node of each list) *settles* once every key has an answer and the nodes still
silent have had :func:`grace` more: those are stragglers, left behind, so a hung
node costs such a question the grace, not the client's timeout.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["Coverage", "IntArray", "LeftBehind", "Pick", "grace", "pick", "pick_live"]

IntArray = npt.NDArray[np.intp]


class Pick(NamedTuple):
    node: int  #: ring node index
    rows: IntArray  #: batch positions of the keys sent to it
    cols: IntArray  #: the preference-list column of each of them
    # rows are in increasing order: a node that gets every key gets the batch as it was


def pick(table: npt.NDArray[np.int32], tried: npt.NDArray[np.bool_], live: npt.NDArray[np.bool_],
         rows: IntArray, per_row: int | IntArray = 1) -> list[Pick]:
    """Pick up to ``per_row`` untried nodes for each of ``rows`` (one count for all, or
    one per row); marks them in ``tried``. A node gets one group, whatever the counts.

    A row takes its untried columns live ones first, then the others (probes), each in
    list order: what picking one column at a time gives, with one vector step a column
    (a list is 2-4 columns) instead of a pass over the table a pick (that took ~0.47
    ms for 512 keys of 3 nodes here, on every cluster lookup).
    """
    every = len(rows) == len(table)  # all the batch's rows (in order): no gather needed
    sub = table if every else table[rows]
    untried = ~(tried if every else tried[rows])
    cap = np.asarray(per_row)
    if cap.min() >= sub.shape[1]:  # every untried column: the order of taking is moot
        take = untried
    else:
        alive = live[sub]
        got = np.zeros(len(rows), dtype=np.intp)
        take = np.zeros(sub.shape, dtype=bool)
        for phase in (untried & alive, untried & ~alive):
            for col in range(sub.shape[1]):
                now = phase[:, col] & (got < cap)
                take[:, col] |= now
                got += now
    where, cols = np.nonzero(take)  # row-major: each node's rows come out in order
    if not len(where):  # every node of these rows' lists has been tried
        return []
    if every:
        tried |= take
    else:
        tried[rows] |= take
    picked = rows[where]
    nodes = sub[take]  # the same row-major order
    # group by node, rows in order within each: a stable sort, by radix on narrow ints
    # (the step took ~100 us of a 512-key pick as int32 argsort and slicing)
    by_node = np.argsort(nodes.astype(np.uint16) if len(live) <= 0xFFFF else nodes,
                         kind="stable")
    picked, cols = picked[by_node], cols[by_node]
    counts = np.bincount(nodes, minlength=len(live))
    present = np.flatnonzero(counts)
    ends = np.cumsum(counts[present]).tolist()
    return [Pick(node, picked[a:b], cols[a:b])
            for node, a, b in zip(present.tolist(), [0, *ends[:-1]], ends, strict=True)]


def pick_live(table: npt.NDArray[np.int32], tried: npt.NDArray[np.bool_],
              live: npt.NDArray[np.bool_], rows: IntArray) -> list[Pick]:
    """Every live untried node of each of ``rows`` at once; for a row none of whose untried
    nodes is live, its first untried one (a probe). EXISTS asks this way: a node marked
    down (hung, say) is not waited for on every call while others of the list answer."""
    untried_live = live[table[rows]] & ~tried[rows]
    return pick(table, tried, live, rows, per_row=np.maximum(untried_live.sum(axis=1), 1))


#: a settling question waits for stragglers at least this long once every key has an
#: answer, and at least this many times what the answers took
GRACE_MIN_S = 0.05
GRACE_FACTOR = 4.0


def grace(elapsed: float, timeout: float) -> float:
    """How much longer a settling question waits for its silent nodes once every key has an
    answer, ``elapsed`` seconds after it was sent: ``GRACE_FACTOR`` times that, at least
    ``GRACE_MIN_S`` (a loaded host's scheduling noise), at most the client's ``timeout``."""
    return min(timeout, max(GRACE_MIN_S, GRACE_FACTOR * elapsed))


class LeftBehind(Exception):
    """The outcome of a node's part of a settling question that was not waited for."""


class Coverage:
    """Which rows of a settling question have an answer: ``rows[i]`` are those node ``i``
    was asked about; :meth:`add` a node that answered; :attr:`full` once every row has one.
    Where every node was asked about the same rows (a small cluster: the whole batch to
    every node), the first answer covers them all, with no per-row count."""

    def __init__(self, rows: list[IntArray]) -> None:
        self._rows = rows
        self._same = all(r is rows[0] for r in rows)
        self._left = len(rows[0]) if self._same and rows else 0
        if not self._same:
            size = max((int(r.max()) + 1 for r in rows if len(r)), default=0)
            self._answered = np.ones(size, dtype=bool)  # rows no node was asked about: moot
            for r in rows:
                self._answered[r] = False
            self._left = int(np.count_nonzero(~self._answered))

    def add(self, i: int) -> None:
        if self._same:
            self._left = 0
            return
        rows = self._rows[i]
        new = rows[~self._answered[rows]]
        self._answered[new] = True
        self._left -= len(new)

    @property
    def full(self) -> bool:
        return self._left == 0
