"""``pick``: which node gets which keys of a batch (pure; no nodes needed)."""

from __future__ import annotations

import numpy as np

from kvpool.client._routing import pick


def table() -> np.ndarray:
    # 3 keys, preference lists over 3 nodes: owners first, then the fallback
    return np.array([[0, 1, 2], [1, 2, 0], [2, 0, 1]], dtype=np.int32)


def test_first_live_untried_node_per_row_grouped_by_node() -> None:
    tried = np.zeros((3, 3), dtype=bool)
    live = np.array([True, False, True])
    picks = pick(table(), tried, live, np.arange(3))
    assert {p.node: p.rows.tolist() for p in picks} == {0: [0], 2: [1, 2]}
    assert tried.tolist() == [[True, False, False], [False, True, False],
                              [True, False, False]]


def test_a_row_with_no_live_node_probes_its_first_untried_one() -> None:
    tried = np.zeros((3, 3), dtype=bool)
    live = np.zeros(3, dtype=bool)
    picks = pick(table(), tried, live, np.array([1]))
    assert [(p.node, p.rows.tolist(), p.cols.tolist()) for p in picks] == [(1, [1], [0])]


def test_rows_with_every_node_tried_get_no_pick() -> None:
    """The soak found this: a write still needing a replica after every node was tried."""
    tried = np.ones((3, 3), dtype=bool)
    live = np.ones(3, dtype=bool)
    assert pick(table(), tried, live, np.array([0, 2])) == []
    tried[1] = False  # the other rows still get theirs
    picks = pick(table(), tried, live, np.array([0, 1, 2]))
    assert [(p.node, p.rows.tolist()) for p in picks] == [(1, [1])]
