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


def test_several_nodes_a_row_come_as_one_group_per_node() -> None:
    """Replicas or a lookup's every owner: a node gets all its rows in one group (one
    frame), with each row's own count of nodes still needed."""
    tried = np.zeros((3, 3), dtype=bool)
    live = np.ones(3, dtype=bool)
    picks = pick(table(), tried, live, np.arange(3), per_row=np.array([2, 1, 3]))
    assert {p.node: p.rows.tolist() for p in picks} == {0: [0, 2], 1: [0, 1, 2], 2: [2]}
    assert tried.sum(axis=1).tolist() == [2, 1, 3]
    again = pick(table(), np.zeros((3, 3), dtype=bool), live, np.arange(3), per_row=2)
    assert sorted(p.node for p in again) == [0, 1, 2]  # each node once
