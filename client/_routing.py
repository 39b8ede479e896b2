"""Choosing which node gets which keys of a batch. Pure (numpy), no I/O.

Every key of a batch has a preference list: a row of ring node indexes,
owners first, then fallbacks (``ClusterMap.preference``). A *pick* takes,
for each pending row, the first column not tried yet whose node is live,
and groups the picks by node so each node gets one sub-batch. If none of a
row's untried nodes is live, the pick probes the first untried one anyway:
back-off is a hint, and a request to a node thought down is how it comes
back.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["Pick", "pick", "pick_live"]

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
