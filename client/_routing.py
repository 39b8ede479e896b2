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

__all__ = ["Pick", "pick"]

IntArray = npt.NDArray[np.intp]


class Pick(NamedTuple):
    node: int  #: ring node index
    rows: IntArray  #: batch positions of the keys sent to it
    cols: IntArray  #: the preference-list column of each of them
    # rows are in increasing order: a node that gets every key gets the batch as it was


def pick(table: npt.NDArray[np.int32], tried: npt.NDArray[np.bool_], live: npt.NDArray[np.bool_],
         rows: IntArray, per_row: int | IntArray = 1) -> list[Pick]:
    """Pick up to ``per_row`` untried nodes for each of ``rows`` (one count for all, or
    one per row); marks them in ``tried``. A node gets one group, whatever the counts."""
    want = np.broadcast_to(np.asarray(per_row, dtype=np.intp), rows.shape)
    picked_rows: list[IntArray] = []
    picked_cols: list[IntArray] = []
    for i in range(int(want.max(initial=0))):
        rows, want = rows[want > i], want[want > i]
        if not len(rows):
            break
        sub = table[rows]
        untried = ~tried[rows]
        ok = untried & live[sub]
        dead = ~ok.any(axis=1)
        ok[dead] = untried[dead]
        has = ok.any(axis=1)
        rows, want = rows[has], want[has]  # a row whose every node is tried is done
        cols = ok[has].argmax(axis=1)
        tried[rows, cols] = True
        picked_rows.append(rows)
        picked_cols.append(cols)
    all_rows = np.concatenate(picked_rows) if picked_rows else rows[:0]
    if not len(all_rows):  # every node of these rows' lists has been tried
        return []
    all_cols = np.concatenate(picked_cols)
    nodes = table[all_rows, all_cols]
    order = np.lexsort((all_rows, nodes))  # by node, then batch position
    nodes, all_rows, all_cols = nodes[order], all_rows[order], all_cols[order]
    bounds = np.flatnonzero(np.diff(nodes)) + 1
    return [Pick(int(n[0]), r, c) for n, r, c in zip(np.split(nodes, bounds),
                                                      np.split(all_rows, bounds),
                                                      np.split(all_cols, bounds), strict=True)]
