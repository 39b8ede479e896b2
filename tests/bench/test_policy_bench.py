"""bench.policy's bounds on hand-made traces: the optimum, and a policy given an
admission oracle (never storing a chunk no later request asks for)."""

from __future__ import annotations

import math

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
