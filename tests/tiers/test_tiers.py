"""The Tier interface, run against every tier: DRAM, RocksDB (SSD) and S3 (a real local server)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.protocol.envelope import seal
from kvpool.tiers.base import Tier
from kvpool.tiers.dram import DramTier
from kvpool.tiers.rocksdb import RocksDbTier
from kvpool.tiers.s3 import S3Tier


def chunk(n: int = 1000, index: int = 0) -> bytes:
    payload = os.urandom(n)
    return seal(payload, chunk_index=index) + payload


CAPACITY = 1 << 20
TIERS: dict[str, Callable[[Path], Tier]] = {
    "dram": lambda _path: DramTier(CAPACITY),
    "ssd": lambda path: RocksDbTier(path / "ssd", CAPACITY),
}


@pytest.fixture(params=[*TIERS, "s3"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    if request.param == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = request.getfixturevalue("s3_bucket")
        t: Tier = S3Tier(bucket, endpoint_url=endpoint, region="us-east-1",
                         capacity_bytes=CAPACITY)
    else:
        t = TIERS[request.param](tmp_path)
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


def test_capacity_and_eviction(tier: Tier) -> None:
    keys = [bytes([i]) * 16 for i in range(10)]
    for k in keys:
        assert tier.put(k, chunk(CAPACITY // 4 - 8192))
    s = tier.stats()
    assert s.used_bytes <= CAPACITY and s.evictions >= 6
    assert tier.contains(keys[-1]) and not tier.contains(keys[0])
    assert sum(tier.contains(k) for k in keys) == s.num_objects <= 4


def test_value_larger_than_capacity_is_refused(tier: Tier) -> None:
    assert not tier.put(b"big" + bytes(13), chunk(CAPACITY + 1))
    assert tier.stats().rejections == 1


def test_the_cold_tiers_ledger_evicts_least_recent_then_deepest_until_the_bytes_fit() -> None:
    from kvpool.tiers.ledger import Held, Ledger

    ledger: Ledger[Held] = Ledger()
    for key, size, depth in ((b"a", 10, 0), (b"b", 10, 1), (b"c", 10, 2), (b"d", 10, 0)):
        ledger.add(key, Held(size, depth))
    ledger.touch(b"a")  # now the most recent: b, c, d are older
    assert ledger.used == 40 and len(ledger) == 4
    assert ledger.victims(capacity=40) == []  # it fits already
    assert ledger.victims(capacity=40, incoming=15) == [b"b", b"c"]
    assert (ledger.used, sorted(ledger)) == (20, [b"a", b"d"])
    ledger.add(b"d", Held(25, 3))  # a key stored again counts once, at its new size
    assert ledger.used == 35 and ledger.forget(b"a") == Held(10, 0)
    assert ledger.forget(b"a") is None
    assert ledger.victims(capacity=0) == [b"d"] and ledger.used == 0


def test_a_key_held_out_of_the_ledgers_order_is_never_a_victim_until_touched() -> None:
    """The DRAM tier's pins: held out (``hold_out``, or added with ``used_now=False`` and
    never touched), a key counts its bytes but is not offered; a batch touched together
    puts its deepest keys first to evict."""
    from kvpool.tiers.ledger import Held, Ledger

    ledger: Ledger[Held] = Ledger()
    ledger.add(b"p", Held(10, 0))
    ledger.hold_out(b"p")
    for key, depth in ((b"x", 0), (b"y", 1), (b"z", 2)):
        ledger.add(key, Held(10, depth), used_now=False)
    assert (ledger.used, ledger.evictable, list(ledger.candidates())) == (40, 0, [])
    ledger.touch_many([(b"x", 0), (b"y", 1), (b"z", 2)])
    assert list(ledger.candidates()) == [b"z", b"y", b"x"]
    assert ledger.victims(capacity=0) == [b"z", b"y", b"x"]  # never the held-out key
    assert (ledger.used, ledger.keys(), ledger.evictable) == (10, [b"p"], 0)
    ledger.touch(b"p")  # back in the order (an unpin)
    assert ledger.victims(capacity=0) == [b"p"] and len(ledger) == 0


def test_tenant_chunks_name_the_tenants_oldest_chunks_and_count_writes_on_their_way() -> None:
    """The SSD's quotas: a tenant over its quota gives up its own oldest chunks, writes
    still queued count as written, and a value that can never fit gives up nothing."""
    from kvpool.tiers.tenants import TenantChunks

    quotas = TenantChunks()
    quotas.tenants.quotas = {"acme": 100}
    assert quotas.limits("acme") and not quotas.limits("bolt") and not quotas.limits(None)
    for i in range(4):
        quotas.add(bytes([i]) * 16, "acme", 25)
    assert quotas.tenants.used == {"acme": 100}
    assert quotas.victims("acme", 30) == [b"\x00" * 16, b"\x01" * 16]  # oldest first
    quotas.add(b"\x00" * 16, "acme", 25)  # written again: now the newest
    assert quotas.victims("acme", 10) == [b"\x01" * 16]
    quotas.queue("acme", 40)  # on its way: counted as written
    assert quotas.victims("acme", 10) == [b"\x01" * 16, b"\x02" * 16]
    quotas.arrived("acme", 40)
    assert quotas.victims("acme", 101) is None  # more than the quota: nothing given up
    quotas.queue("acme", 90)
    assert quotas.victims("acme", 20) is None  # with all four gone, still 10 too many
    quotas.arrived("acme", 90)
    quotas.forget(b"\x01" * 16)
    assert quotas.tenants.used == {"acme": 75} and quotas.victims("acme", 25) == []
