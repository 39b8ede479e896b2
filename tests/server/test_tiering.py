"""The tier manager without the wire: DRAM over a real SSD worker (real RocksDB files),
and the same tests over an in-memory cold tier (``tests/memory_cold.py``: no process)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvpool.protocol.envelope import Codec, seal
from kvpool.protocol.frames import Tier
from kvpool.protocol.worker import WorkerSettings
from kvpool.server.admin.events import EventBus, Subscription
from kvpool.server.cold.base import ColdTier, NoColdTier
from kvpool.server.cold.ssd import SsdTier
from kvpool.server.cold.tiering import TieringPolicy, TierManager
from kvpool.tiers.dram import DramTier, Entry
from tests.memory_cold import MemoryColdTier


def value_of(n: int) -> bytes:
    payload = os.urandom(n)
    return seal(payload, chunk_index=0) + payload


def put(tiers: TierManager, key: bytes, value: bytes, ttl_s: float | None = None
        ) -> Entry:
    """What a PUT does to the tiers: a slot received into, committed, written behind."""
    slot = tiers.dram.reserve(key, len(value))
    assert slot is not None
    slot.view[:] = value
    (entry,) = tiers.commit([slot], ttl_s=[ttl_s], pin=[False], parents=[None])
    assert entry is not None
    assert tiers.through([entry]) == []  # no write-through without S3
    tiers.write_behind([entry])
    return entry


async def settled(ssd: ColdTier) -> None:
    """Write-behind is asynchronous: wait (bounded) for the queue to drain."""
    for _ in range(500):
        if not ssd.counters.pending_writes:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(ssd.counters)


def drained(bus: EventBus, sub: Subscription) -> list[tuple[str, str]]:
    return [(event.kind, event.data["tier"]) for event in bus.take(sub)]


@pytest.fixture(params=["worker", "memory"])
async def tiers(request: pytest.FixtureRequest, tmp_path: Path
                ) -> AsyncIterator[TierManager]:
    dram = DramTier(8 << 20)
    cold: ColdTier
    if request.param == "worker":
        cold = SsdTier(tmp_path, WorkerSettings(16 << 20, Codec.LZ4), arena_fd=dram.arena.fd,
                       arena_size=dram.arena.capacity, max_pending_bytes=4 << 20)
        await cold.start()
    else:
        cold = MemoryColdTier(dram.arena.view)
    # write-through, but no S3: nothing to wait on
    yield TierManager(dram, cold, EventBus("t"), policy=TieringPolicy(write_through=True))
    await cold.stop()


async def test_a_chunk_goes_behind_to_ssd_leaves_dram_and_is_promoted_back(
        tiers: TierManager) -> None:
    sub = tiers.events.subscribe()
    ssd = tiers.cold
    key, other, value = b"k" * 16, b"o" * 16, value_of(200_000)
    put(tiers, key, value)
    await settled(ssd)
    assert key in ssd.index
    assert list(tiers.tiers([key, other])) == [Tier.DRAM, 0]
    assert tiers.evict("dram", None) == {"dram": 1, "ssd": 0}
    assert list(tiers.tiers([key, other])) == [Tier.SSD, 0]

    entries = tiers.acquire([key, other])
    assert entries == [None, None]
    assert tiers.below([key, other], entries) == [0]  # only what the SSD index holds
    await tiers.promote([key, other], entries, [0])
    entry = entries[0]
    assert entry is not None and entries[1] is None
    assert bytes(tiers.dram.view(entry)) == value  # the worker verified and copied it
    assert entry.readers == 1  # held for the reply being built, as acquire's are
    tiers.dram.release(entry)
    assert tiers.promotions == 1
    assert list(tiers.tiers([key])) == [Tier.DRAM]
    assert drained(tiers.events, sub) == [("stored", "dram"), ("demoted", "ssd"),
                                          ("stored", "dram")]
    info = tiers.chunk_info(key)
    assert info is not None and info["tiers"] == ["dram", "ssd"]
    snap = await tiers.snapshot()
    assert snap["promotions"] == 1 and snap["tiers"]["ssd"]["num_objects"] == 1


async def test_a_chunk_with_a_ttl_never_goes_below_dram(tiers: TierManager) -> None:
    ssd = tiers.cold
    key = b"t" * 16
    put(tiers, key, value_of(50_000))  # first without a TTL: it reaches the SSD
    await settled(ssd)
    assert key in ssd.index
    assert tiers.delete([key]) == [True]
    assert list(tiers.tiers([key])) == [0]
    put(tiers, key, value_of(50_000))
    await settled(ssd)
    tiers.dram.delete_many([key])  # DRAM alone loses it; the SSD copy stays
    assert list(tiers.tiers([key])) == [Tier.SSD]
    put(tiers, key, value_of(50_000), ttl_s=60)  # the same key, now with a TTL
    await settled(ssd)
    assert key not in ssd.index  # its cold copy is gone: it cannot outlive the TTL
    assert list(tiers.tiers([key])) == [Tier.DRAM]


async def test_delete_reaches_every_tier_and_says_which_held_it(tiers: TierManager) -> None:
    sub = tiers.events.subscribe(frozenset({"removed"}))
    ssd = tiers.cold
    keys = [bytes([i]) * 16 for i in range(3)]
    for key in keys[:2]:
        put(tiers, key, value_of(10_000))
    await settled(ssd)
    tiers.dram.delete_many([keys[1]])  # on the SSD only
    assert tiers.delete(keys) == [True, True, False]
    assert list(tiers.tiers(keys)) == [0, 0, 0]
    assert drained(tiers.events, sub) == [("removed", "dram"), ("removed", "ssd")]
    assert tiers.chunk_info(keys[0]) is None
    assert (await tiers.flush(5.0))["flushed"]


async def test_the_cold_tier_reports_what_it_let_go_of(tiers: TierManager) -> None:
    """A key the tier below dropped to make room is an ``evicted`` event when DRAM no
    longer holds it, and no event while DRAM still does (the node's view is the same)."""
    sub = tiers.events.subscribe(frozenset({"evicted", "demoted"}))
    ssd = tiers.cold
    held, gone = b"h" * 16, b"g" * 16
    for key in (held, gone):
        put(tiers, key, value_of(10_000))
    await settled(ssd)
    tiers.dram.delete_many([gone])
    ssd.evict(held)
    ssd.evict(gone)
    assert drained(tiers.events, sub) == [("evicted", "ssd")]
    assert list(tiers.tiers([held, gone])) == [Tier.DRAM, 0]


async def test_dram_only_promotes_nothing() -> None:
    tiers = TierManager(DramTier(1 << 20), NoColdTier(), EventBus())
    key = b"d" * 16
    put(tiers, key, value_of(1000))
    entries = tiers.acquire([key, b"x" * 16])
    assert entries[0] is not None and tiers.below([key, b"x" * 16], entries) == []
    tiers.dram.release(entries[0])
    assert tiers.evict("ssd", None) == {"dram": 0, "ssd": 0}
    assert await tiers.flush(0.1) == {"flushed": True, "pending_writes": 0}


async def test_write_through_waits_for_s3_and_a_miss_everywhere_else_is_fetched_from_it(
        ) -> None:
    """S3 below the SSD (the in-memory tier): a write-through PUT is durable once S3 has
    it; a chunk only S3 still holds is fetched into DRAM and written behind to the SSD."""
    dram = DramTier(4 << 20)
    cold = MemoryColdTier(dram.arena.view, s3=True)
    tiers = TierManager(dram, cold, EventBus(), policy=TieringPolicy(s3=True,
                                                                     write_through=True))
    key, value = b"s" * 16, value_of(20_000)
    slot = dram.reserve(key, len(value))
    assert slot is not None
    slot.view[:] = value
    (entry,) = tiers.commit([slot], ttl_s=[None], pin=[False], parents=[None])
    assert entry is not None and tiers.through([entry]) == [0]
    assert await tiers.make_durable([entry]) == [True]
    assert cold.s3[key] == value and key in cold.index
    cold.evict(key)  # the SSD drops it; S3 keeps it
    tiers.evict("dram", None)
    assert list(tiers.tiers([key])) == [Tier.S3]
    entries = tiers.acquire([key])
    assert tiers.below([key], entries) == [0]
    await tiers.promote([key], entries, [0])
    promoted = entries[0]
    assert promoted is not None and bytes(dram.view(promoted)) == value
    dram.release(promoted)
    await settled(cold)
    assert key in cold.index  # written behind to the SSD again
    assert await tiers.make_durable([promoted]) == [True]  # S3 confirmed it, no new write
    assert cold.counters.writes == 2


async def test_a_cold_tier_that_went_down_leaves_dram_serving_alone() -> None:
    dram = DramTier(4 << 20)
    cold = MemoryColdTier(dram.arena.view)
    tiers = TierManager(dram, cold, EventBus())
    kept, lost = b"k" * 16, b"l" * 16
    put(tiers, kept, value_of(1000))
    await settled(cold)
    await cold.stop()  # the worker died
    put(tiers, lost, value_of(1000))
    assert cold.counters.shed == 1  # its write was dropped, and counted
    assert list(tiers.tiers([kept, lost])) == [Tier.DRAM, Tier.DRAM]
    tiers.dram.delete_many([kept])
    entries = tiers.acquire([kept])
    assert tiers.below([kept], entries) == []  # nothing is promoted from a tier that is down
    assert list(tiers.tiers([kept])) == [0]
    assert (await tiers.snapshot())["tiers"]["ssd"]["up"] is False


async def test_a_delete_overtakes_the_writes_of_its_key_queued_before_it(
        tiers: TierManager) -> None:
    """A chunk deleted while its write-behind is still queued: the write completes first
    (the tier serves them in order) but the key is not held below after either."""
    cold = tiers.cold
    key = b"q" * 16
    put(tiers, key, value_of(30_000))
    assert cold.counters.pending_writes == 1 and cold.holds(key)
    assert tiers.delete([key]) == [True]
    await settled(cold)
    assert key not in cold.index and not cold.holds(key)
    assert list(tiers.tiers([key])) == [0]
