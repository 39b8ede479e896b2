"""The Tier interface, run against every tier (DRAM today; SSD and S3 join this list)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
from kvpool.protocol.envelope import seal
from kvpool.tiers.base import Tier
from kvpool.tiers.dram import DramTier


def chunk(n: int = 1000, index: int = 0) -> bytes:
    payload = os.urandom(n)
    return seal(payload, chunk_index=index) + payload


TIERS: dict[str, Callable[[], Tier]] = {
    "dram": lambda: DramTier(1 << 20),
}


@pytest.fixture(params=list(TIERS))
def tier(request: pytest.FixtureRequest) -> Iterator[Tier]:
    t = TIERS[request.param]()
    yield t
    close = getattr(t, "close", None)
    if close:
        close()


def test_put_get_roundtrip(tier: Tier) -> None:
    value = chunk()
    assert tier.put(b"k" * 16, value)
    assert tier.get(b"k" * 16) == value
    assert tier.contains(b"k" * 16)


def test_miss(tier: Tier) -> None:
    assert tier.get(b"m" * 16) is None
    assert not tier.contains(b"m" * 16)
    assert not tier.delete(b"m" * 16)


def test_overwrite_and_delete(tier: Tier) -> None:
    tier.put(b"k" * 16, chunk(10))
    second = chunk(20)
    tier.put(b"k" * 16, second)
    assert tier.get(b"k" * 16) == second
    assert tier.stats().num_objects == 1
    assert tier.delete(b"k" * 16)
    assert tier.get(b"k" * 16) is None
    assert tier.stats().used_bytes == 0


def test_stats_count(tier: Tier) -> None:
    tier.put(b"a" * 16, chunk(100))
    tier.get(b"a" * 16)
    tier.get(b"b" * 16)
    s = tier.stats()
    assert (s.num_objects, s.hits, s.misses, s.insertions) == (1, 1, 1, 1)
    assert s.used_bytes == 164


def test_rejects_non_envelope(tier: Tier) -> None:
    assert not tier.put(b"x" * 16, b"not an envelope" * 10)
    assert tier.get(b"x" * 16) is None
