"""bench.placement_sim's exact balance: the ring's arcs give what many keys give."""

from __future__ import annotations

import numpy as np

from bench.placement_sim import exact_balance, labelled_nodes, stream
from kvpool.placement.ring import Ring


def sampled_balance(ring: Ring, weights: dict[str, float], r: int, keys: int
                    ) -> tuple[float, float]:
    counts = np.zeros(len(ring.nodes), dtype=np.int64)
    for positions in stream(keys, 500_000, seed=3):
        counts += np.bincount(ring.owner_indexes(positions, r).ravel(),
                              minlength=len(ring.nodes))
    per_weight = counts / np.array([weights[n] for n in ring.nodes])
    return float(per_weight.max() / per_weight.mean()), float(per_weight.min() / per_weight.mean())


def test_exact_balance_is_what_many_keys_give_with_and_without_domains() -> None:
    # few points a node, so that the ring is far from even and a wrong arc would show
    weights = {f"n{i}": float(1 + i % 3) for i in range(8)}
    plain = Ring(weights, width=2, vnodes_per_weight=8)
    for r in (1, 2):
        exact, sampled = exact_balance(plain, weights, r), sampled_balance(plain, weights, r,
                                                                           2_000_000)
        assert exact[0] > 1.05  # uneven enough to tell
        assert abs(exact[0] - sampled[0]) < 0.02 and abs(exact[1] - sampled[1]) < 0.02
    labelled, domains = labelled_nodes(hosts=6, per_host=2, hosts_per_rack=2, zones=3, seed=0)
    spread = Ring(labelled, width=3, vnodes_per_weight=8, domains=domains)
    exact, sampled = exact_balance(spread, labelled, 3), sampled_balance(spread, labelled, 3,
                                                                          2_000_000)
    assert abs(exact[0] - sampled[0]) < 0.02 and abs(exact[1] - sampled[1]) < 0.02


def test_one_node_holds_everything() -> None:
    assert exact_balance(Ring({"a": 2.0}, width=1), {"a": 2.0}, 1) == (1.0, 1.0)
