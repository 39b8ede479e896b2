"""``pick``: which node gets which keys of a batch; when a question several nodes are
asked settles (pure; no nodes needed)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.client._routing import GRACE_MIN_S, Coverage, Settle, grace, pick, pick_live


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


def test_pick_live_takes_every_live_node_of_a_row_or_one_probe() -> None:
    """EXISTS's pick: each row's live untried nodes at once; a row with none live probes
    its first untried node; node 1 (down) is asked only for the row it is alone in."""
    t = np.array([[0, 1, 2], [1, 2, 0], [1, 2, 0]], dtype=np.int32)
    tried = np.zeros((3, 3), dtype=bool)
    tried[2] = [False, True, True]  # row 2: only node 1 (down) untried
    live = np.array([True, False, True])
    picks = pick_live(t, tried, live, np.arange(3))
    assert {p.node: p.rows.tolist() for p in picks} == {0: [0, 1], 1: [2], 2: [0, 1]}
    assert tried.tolist() == [[True, False, True], [False, True, True], [True, True, True]]


def reference_pick(table: np.ndarray, tried: np.ndarray, live: np.ndarray, rows: np.ndarray,
                   per_row: int | np.ndarray = 1) -> dict[int, list[tuple[int, int]]]:
    """The rule, one key and one column at a time: each pick is the row's first untried
    live column, else its first untried one; ``{node: [(row, col), ...]}``."""
    want = np.broadcast_to(np.asarray(per_row), rows.shape)
    out: dict[int, list[tuple[int, int]]] = {}
    for row, count in zip(rows.tolist(), want.tolist(), strict=True):
        for _ in range(count):
            untried = [c for c in range(table.shape[1]) if not tried[row, c]]
            if not untried:
                break
            col = next((c for c in untried if live[table[row, c]]), untried[0])
            tried[row, col] = True
            out.setdefault(int(table[row, col]), []).append((row, col))
    return out


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_pick_gives_what_picking_one_column_at_a_time_gives(data: st.DataObject) -> None:
    nodes = data.draw(st.integers(1, 6))
    width = data.draw(st.integers(1, min(nodes, 4)))
    n = data.draw(st.integers(1, 40))
    table = np.array([data.draw(st.permutations(range(nodes)))[:width] for _ in range(n)],
                     dtype=np.int32)
    tried = np.array(data.draw(st.lists(st.lists(st.booleans(), min_size=width,
                                                 max_size=width), min_size=n, max_size=n)),
                     dtype=bool).reshape(n, width)
    live = np.array(data.draw(st.lists(st.booleans(), min_size=nodes, max_size=nodes)))
    rows = np.array(sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1))),
                    dtype=np.intp)
    per_row = data.draw(st.one_of(st.integers(0, width + 1), st.just(
        np.array(data.draw(st.lists(st.integers(0, width), min_size=len(rows),
                                    max_size=len(rows))), dtype=np.intp))))
    expect_tried = tried.copy()
    expect = reference_pick(table, expect_tried, live, rows, per_row)
    picks = pick(table, tried, live, rows, per_row)
    assert {p.node: list(zip(p.rows.tolist(), p.cols.tolist(), strict=True)) for p in picks} \
        == expect
    assert [p.node for p in picks] == sorted(expect)  # one group a node, by node
    assert (tried == expect_tried).all()


def test_coverage_is_full_once_every_row_asked_about_has_an_answer() -> None:
    """Node 0 was asked rows 0-2, node 1 rows 2-4, node 2 rows 0 and 4; row 5 of the
    batch was asked of nobody (done before this round): moot."""
    rows = [np.array([0, 1, 2]), np.array([2, 3, 4]), np.array([0, 4])]
    coverage = Coverage(rows)
    coverage.add(0)
    assert not coverage.full  # rows 3 and 4 have no answer
    coverage.add(2)
    assert not coverage.full  # row 3
    coverage.add(2)  # the same answer twice counts once
    assert not coverage.full
    coverage.add(1)
    assert coverage.full
    other = Coverage([np.array([0, 1]), np.array([1, 2])])
    other.add(1)
    assert not other.full  # row 0: only node 0 was asked
    assert Coverage([np.array([], dtype=np.intp)]).full
    batch = np.arange(4)  # a small cluster: every node asked about the whole batch
    whole = Coverage([batch, batch, batch])
    assert not whole.full
    whole.add(2)
    assert whole.full


def test_a_key_is_settled_by_an_owner_not_by_the_first_node_that_lacks_it() -> None:
    """Replication 2 of a list of 3 (need 2 answers, one node may be silent): the first
    answer, from the node past a key's owners, does not settle it while the owners are
    silent (one of them slow on a busy host, not hung); the second answer does, whichever
    node gives it. Once a node of the map is known to be down or suspect, the one silent
    node allowed is spent: every trusted node asked is waited for, never a suspect one."""
    rule = Settle.for_map(width=3, owners=2, healthy=True)
    assert rule == Settle(need=2, spare=1)
    batch = np.arange(4)
    healthy = Coverage([batch, batch, batch], rule)
    healthy.add(2)
    assert not healthy.full  # a non-owner's "not here" settles nothing
    healthy.add(1)
    assert healthy.full  # node 0 (hung, not yet known) is not waited for
    wary = Settle.for_map(width=3, owners=2, healthy=False)
    assert wary == Settle(need=2, spare=0)
    suspect_first = Coverage([batch, batch, batch], wary, counted=[False, True, True])
    suspect_first.add(2)
    assert not suspect_first.full  # node 1, trusted, is waited for
    suspect_first.add(1)
    assert suspect_first.full  # node 0, suspect, is not
    two_asked = Coverage([batch, batch], wary)  # node 0 down: not asked
    two_asked.add(1)
    two_asked.add(1)  # one outcome a node
    assert not two_asked.full
    two_asked.fail(0)  # failed: its rows wait for it no more
    assert two_asked.full
    # a list of 3 out of 4 nodes: each row counts the nodes asked about it
    rows = [np.array([0, 1]), np.array([0, 2]), np.array([1, 2]), np.array([0, 1, 2])]
    spread = Coverage(rows, rule)  # each row asked of 3 nodes: 2 answers settle it
    spread.add(3)
    assert not spread.full
    spread.add(0)
    assert not spread.full  # row 2: only node 3 answered
    spread.add(2)
    assert spread.full
    # no replication (a list of owner + fallback): one answer, as before
    assert Settle.for_map(width=2, owners=1, healthy=True) == Settle(need=2, spare=1)
    single = Coverage([batch, batch], Settle.for_map(width=2, owners=1, healthy=True))
    single.add(1)
    assert single.full


def test_grace_is_a_multiple_of_the_answers_time_within_bounds() -> None:
    assert grace(0.0001, 5.0) == GRACE_MIN_S  # fast answers: the floor (scheduling noise)
    assert grace(0.1, 5.0) == 0.4  # four times what the answers took
    assert grace(3.0, 5.0) == 5.0  # never past the client's timeout
