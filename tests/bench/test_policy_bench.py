"""bench.policy's bounds on hand-made traces: the optimum, and a policy given an
admission oracle (never storing a chunk no later request asks for)."""

from __future__ import annotations

import math

import pytest

from bench.policy import chain, next_uses, optimum, replay_tier

SHARED = chain(["a"])
ONE_OFFS = [chain([f"x{i}"]) for i in range(2)]
#: a chunk asked for three times, a one-off between each: room for one chunk keeps it
TRACE = [SHARED, ONE_OFFS[0], SHARED, ONE_OFFS[1], SHARED]


def test_next_uses_name_the_next_request_or_none() -> None:
    assert next_uses(TRACE) == [[2], [math.inf], [4], [math.inf], [math.inf]]


def test_the_admission_oracle_keeps_what_lru_lets_one_off_chunks_push_out() -> None:
    assert optimum(TRACE, 1) == 2 / 5
    assert replay_tier(TRACE, 1, "lru")["hit_ratio"] == 0
    assert replay_tier(TRACE, 1, "lru", nxt=next_uses(TRACE))["hit_ratio"] == 2 / 5


def test_the_hot_path_pairs_each_run_with_the_same_run_of_the_baseline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow machine stretches both policies of a run alike: the paired ratio stays 1.1x
    while the medians of each policy alone span a factor of 3."""
    import bench.policy as bp

    runs = {"in process": 0, "through nodes": 0}

    def us(run: int, policy: str) -> float:
        return (1.0, 3.0, 2.0)[run] * (1.1 if policy == "chain" else 1.0)

    def in_process(policy: str, **_: object) -> dict[str, float]:
        run = runs["in process"] // 2  # two policies a run
        runs["in process"] += 1
        return {"put_us": us(run, policy), "get_us": us(run, policy)}

    def through_nodes(policies: list[str], **_: object) -> dict[str, dict[str, float]]:
        run = runs["through nodes"] // 3  # three chunk sizes a run, every policy at once
        runs["through nodes"] += 1
        return {p: {"put_p50_us": us(run, p), "get_p50_us": us(run, p)} for p in policies}

    monkeypatch.setattr(bp, "hot_path", in_process)
    monkeypatch.setattr(bp, "hot_path_tcp", through_nodes)
    out = bp.run_hot_path(["chain", "lru"], 3)
    for k in ("put_us", "put_p50_us", "get_p50_us_1m"):
        paired = out["chain / lru"][k]
        assert math.isclose(paired["min"], 1.1) and math.isclose(paired["max"], 1.1), k
        assert out["lru"][k]["min"] == 1.0 and out["lru"][k]["max"] == 3.0, k
