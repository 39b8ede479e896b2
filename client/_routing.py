"""Choosing which node gets which keys of a batch. Pure (numpy), no I/O.

Every key of a batch has a preference list: a row of ring node indexes,
owners first, then fallbacks (``ClusterMap.preference``). A *pick* takes,
for each pending row, the first column not tried yet whose node is live,
and groups the picks by node so each node gets one sub-batch. If none of a
row's untried nodes is live, the pick probes the first untried one anyway:
back-off is a hint, and a request to a node thought down is how it comes
back.

A question several nodes are asked at once for the same keys (EXISTS: every live
node of each list) *settles* once every key has its answers (:class:`Settle`: one
at least from a node that holds it, an owner, where one is trusted) and the nodes
still silent have had :func:`grace` more: those are stragglers, left behind, so a
hung node costs such a question the grace, not the client's timeout.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["FIRST_ANSWER", "Coverage", "IntArray", "LeftBehind", "Pick", "Settle", "grace",
           "pick", "pick_live"]

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
    if len(rows) <= _FEW:
        return _pick_few(table, tried, live, rows, per_row)
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


#: batches of at most this many keys are picked key by key (no vector steps: ~40 us
#: of a one-key cluster GET went to them)
_FEW = 8


def _pick_few(table: npt.NDArray[np.int32], tried: npt.NDArray[np.bool_],
              live: npt.NDArray[np.bool_], rows: IntArray, per_row: int | IntArray
              ) -> list[Pick]:
    """:func:`pick` of a few rows, one at a time (the same picks, in the same order)."""
    caps = [int(per_row)] * len(rows) if isinstance(per_row, int | np.integer) \
        else np.asarray(per_row).tolist()
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for row, cap in zip(rows.tolist(), caps, strict=True):
        line = table[row].tolist()
        mark = tried[row]
        untried = [col for col, done in enumerate(mark.tolist()) if not done]
        order = [c for c in untried if live[line[c]]] + [c for c in untried if not live[line[c]]]
        for col in order[:max(cap, 0)]:
            mark[col] = True
            got = groups.setdefault(line[col], ([], []))
            got[0].append(row)
            got[1].append(col)
    return [Pick(node, np.array(got[0], dtype=np.intp), np.array(got[1], dtype=np.intp))
            for node, got in sorted(groups.items())]


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


class Settle(NamedTuple):
    """How many answers settle a key of a settling question (EXISTS, a lookup).

    ``need``: answers from that many of the nodes asked about it; a map's
    ``width - replication + 1`` (:meth:`for_map`), so that at least one of the nodes that
    hold the key (its owners) answered: a node that merely sits further down its list
    answering first "not here" does not settle it while an owner, slow on a busy host,
    is still to answer. ``spare``: how many of the nodes asked may be silent (one not yet
    known to be hung) and the key still settle; spent (0) once some node of the map is
    known to be down or suspect, so a second slow node is waited for. Never more than
    the trusted nodes asked can give, never less than one answer."""

    need: int = 1
    spare: int = 0

    @classmethod
    def for_map(cls, width: int, owners: int, healthy: bool) -> Settle:
        return cls(need=max(1, width - owners + 1), spare=1 if healthy else 0)


#: the first answer settles every key (a map refresh: any node's map will do)
FIRST_ANSWER = Settle()


class Coverage:
    """Which rows of a settling question are settled: ``rows[i]`` are those node ``i`` was
    asked about; :meth:`add` a node that answered, :meth:`fail` one that failed; :attr:`full`
    once every row has the answers ``settle`` asks for (:class:`Settle`), capped by the
    nodes ``counted`` (trusted: not down, not suspect) asked about it and not failed. Where
    every node was asked about the same rows (a small cluster: the whole batch to every
    node), one count serves them all."""

    def __init__(self, rows: list[IntArray], settle: Settle = FIRST_ANSWER,
                 counted: list[bool] | None = None) -> None:
        self._counted = counted if counted is not None else [True] * len(rows)
        self._rows = rows
        self._settle = settle
        self._same = all(r is rows[0] for r in rows)
        size = 1 if self._same else \
            max((int(r.max()) + 1 for r in rows if len(r)), default=0)
        self._got = np.zeros(size, dtype=np.intp)
        self._cap = np.zeros(size, dtype=np.intp)
        self._asked = np.zeros(size, dtype=bool)
        for r, c in zip(rows, self._counted, strict=True):
            at: IntArray | slice = slice(None) if self._same else r
            self._asked[at] |= len(r) > 0
            self._cap[at] += c
        self._left = int(np.count_nonzero(self._open(slice(None))))
        self._heard: set[int] = set()  #: nodes counted (answered or failed)

    def _open(self, at: IntArray | slice) -> npt.NDArray[np.bool_]:
        """Of the rows ``at``: those asked about and not yet settled."""
        need = np.maximum(1, np.minimum(self._settle.need, self._cap[at] - self._settle.spare))
        return self._asked[at] & (self._got[at] < need)

    def _count(self, i: int, got: int, cap: int) -> None:
        if i in self._heard:  # one outcome a node
            return
        self._heard.add(i)
        at: IntArray | slice = slice(None) if self._same else self._rows[i]
        before = int(np.count_nonzero(self._open(at)))
        self._got[at] += got
        self._cap[at] -= cap
        self._left += int(np.count_nonzero(self._open(at))) - before

    def add(self, i: int) -> None:
        """Node ``i`` answered."""
        self._count(i, 1, 0)

    def fail(self, i: int) -> None:
        """Node ``i`` failed: its rows wait for it no more."""
        self._count(i, 0, 1 if self._counted[i] else 0)

    @property
    def full(self) -> bool:
        return self._left == 0
