"""DRAM tier: arena allocation, prefix-aware eviction, pinning, TTL, capacity."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE, seal
from kvpool.tiers.arena import ALIGN, Arena
from kvpool.tiers.dram import DramTier
from kvpool.tiers.room import _evictable

PAGE = ALIGN


def value_of(total: int, index: int = 0) -> bytes:
    """An envelope whose whole stored size is ``total`` bytes."""
    payload = os.urandom(total - ENVELOPE_HEADER_SIZE)
    return seal(payload, chunk_index=index) + payload


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- arena ------------------------------------------------------------------------------


def test_arena_coalesces_back_to_one_extent() -> None:
    arena = Arena(64 * PAGE)
    offsets = [arena.alloc(PAGE) for _ in range(64)]
    assert None not in offsets and arena.alloc(1) is None
    for off in offsets[::2] + offsets[1::2]:
        arena.free(off, PAGE)  # type: ignore[arg-type]
    assert arena.largest_free == 64 * PAGE and arena.allocated_bytes == 0


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 8 * PAGE)), max_size=200))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_arena_never_overlaps(ops: list[tuple[bool, int]]) -> None:
    arena = Arena(32 * PAGE)
    live: dict[int, int] = {}
    for do_free, size in ops:
        if do_free and live:
            off = next(iter(live))
            arena.free(off, live.pop(off))
            continue
        off = arena.alloc(size)
        if off is None:
            assert arena.largest_free < Arena.extent(size)
            continue
        end = off + Arena.extent(size)
        assert end <= arena.capacity
        for o, s in live.items():
            assert end <= o or o + Arena.extent(s) <= off
        live[off] = size
    assert arena.allocated_bytes == sum(Arena.extent(s) for s in live.values())


# -- eviction ---------------------------------------------------------------------------


def _allocated(arena: Arena) -> int:
    """Bytes of the arena's memory file the kernel has allocated."""
    return os.fstat(arena.fd).st_blocks * 512


def _wait_allocated(arena: Arena, at_least: int) -> int:
    for _ in range(500):  # bounded: 5 s
        if _allocated(arena) >= at_least:
            break
        time.sleep(0.01)
    return _allocated(arena)


MiB = 1 << 20


@pytest.mark.skipif(not hasattr(os, "posix_fallocate"), reason="no posix_fallocate")
def test_arena_allocates_memory_ahead_of_its_extents_and_no_further() -> None:
    plain = Arena(64 * MiB)
    ahead = Arena(64 * MiB, allocate_ahead=16 * MiB)
    try:
        assert _allocated(plain) == 0  # pages come on first write
        assert _wait_allocated(ahead, 16 * MiB) >= 16 * MiB
        assert ahead.alloc(40 * MiB) == 0  # the frontier moves to 40 MiB: 56 MiB are wanted
        assert _wait_allocated(ahead, 56 * MiB) >= 56 * MiB
        time.sleep(0.05)
        assert _allocated(ahead) <= 56 * MiB + ALIGN * 8  # not the whole capacity
        assert ahead.alloc(20 * MiB) is not None  # near the end: capped at the capacity
        assert _wait_allocated(ahead, 64 * MiB) >= 64 * MiB
        assert _allocated(plain) == 0
    finally:
        plain.close()
        ahead.close()
    thread = ahead._ahead._thread  # type: ignore[union-attr]
    assert not thread.is_alive()  # close waited for it: the descriptor is not used later


def test_lru_eviction_order() -> None:
    tier = DramTier(4 * PAGE, policy="lru")
    for i in range(4):
        assert tier.put(key(i), value_of(PAGE))
    assert tier.get(key(0)) is not None  # 0 becomes most recent
    assert tier.put(key(4), value_of(PAGE))  # evicts 1, the least recent
    assert [tier.contains(key(i)) for i in range(5)] == [True, False, True, True, True]
    assert tier.stats().evictions == 1


def test_a_value_takes_the_extent_of_the_one_it_evicts_of_its_size() -> None:
    """A full tier of one-page values: the victim's page goes to the new value as it lies
    (no free, no allocation between), its generation moved on for readers of the old
    value; a victim being read keeps its page, and the next one is taken."""
    tier = DramTier(4 * PAGE, policy="lru")
    for i in range(4):
        assert tier.put(key(i), value_of(PAGE))
    old = tier._entries[key(0)]
    gen = tier.arena.gens[old.offset // PAGE]
    allocated = tier.arena.allocated_bytes
    slot = tier.reserve(key(4), PAGE)
    assert slot is not None and slot.offset == old.offset
    assert tier.arena.gens[old.offset // PAGE] == gen + 1
    assert tier.arena.allocated_bytes == allocated
    assert not tier.contains(key(0)) and tier.stats().evictions == 1
    slot.view[:] = value_of(PAGE)
    assert tier.commit([slot])[0] is not None
    held = tier.peek(key(1))  # the next victim, held by a reader (no recency)
    assert held is not None
    tier.hold(held)
    data = bytes(tier.view(held))
    slot = tier.reserve(key(5), PAGE)
    assert slot is not None and slot.offset != held.offset
    assert bytes(tier.view(held)) == data and tier.contains(key(1))
    assert not tier.contains(key(2))  # the next victim not being read
    slot.release()
    tier.release(held)


@pytest.mark.parametrize("policy", ["lru", "chain"])
def test_equal_recency_evicts_deepest_first(policy: str) -> None:
    tier = DramTier(4 * PAGE, policy=policy)
    slots = [tier.reserve(key(i), PAGE) for i in range(4)]
    for i, slot in enumerate(slots):
        assert slot is not None
        slot.view[:] = value_of(PAGE, index=i)
    assert all(tier.commit(slots))  # one batch: a prefix of depth 0..3, equally recent
    tier.put(key(9), value_of(PAGE))
    assert not tier.contains(key(3))  # the deepest went first
    tier.put(key(10), value_of(PAGE))
    assert not tier.contains(key(2))
    assert tier.contains(key(0)) and tier.contains(key(1))


def test_batch_read_keeps_prefix_order() -> None:
    """LRU: a prefix read together is equally recent; its deepest chunk goes first (the
    chain policy's rule for chains needs their parents: tests/tiers/test_eviction.py)."""
    tier = DramTier(3 * PAGE, policy="lru")
    for i in range(3):
        tier.put(key(i), value_of(PAGE, index=i))
    entries = tier.acquire_many([key(0), key(1), key(2)])  # read as a prefix
    for e in entries:
        assert e is not None
        tier.release(e)
    tier.put(key(8), value_of(PAGE))
    tier.put(key(9), value_of(PAGE))
    assert [tier.contains(key(i)) for i in range(3)] == [True, False, False]


def test_pinned_never_evicted_and_full_when_all_pinned() -> None:
    tier = DramTier(2 * PAGE)
    tier.put(key(0), value_of(PAGE))
    tier.put(key(1), value_of(PAGE))
    assert tier.pin_many([key(0), key(1), key(7)], True) == [True, True, False]
    assert tier.reserve(key(2), 100) is None  # nothing evictable
    assert tier.stats().rejections == 1
    tier.pin_many([key(1)], False)
    assert tier.put(key(2), value_of(PAGE))
    assert tier.contains(key(0)) and not tier.contains(key(1))


def test_a_value_the_pins_leave_no_room_for_is_refused_with_nothing_evicted() -> None:
    """Pinned entries take 6 of 8 pages: a 3-page value cannot fit whatever is evicted,
    so the two unpinned values stay (they were all evicted, then the PUT refused)."""
    tier = DramTier(8 * PAGE)
    for i in range(8):
        assert tier.put(key(i), value_of(PAGE))
    assert tier.pin_many([key(i) for i in range(6)], True) == [True] * 6
    assert tier.pinned_extents == 6 * PAGE
    assert tier.reserve(key(100), 3 * PAGE) is None
    assert all(tier.contains(key(i)) for i in range(8))
    assert tier.stats().evictions == 0 and tier.stats().rejections == 1
    slot = tier.reserve(key(101), 2 * PAGE)  # fits once both unpinned values go
    assert slot is not None
    slot.release()
    tier.pin_many([key(0)], False)
    tier.delete(key(5))  # a pinned entry deleted: its pages are free again
    assert tier.pinned_extents == 4 * PAGE


def test_overwrite_keeps_pin() -> None:
    tier = DramTier(4 * PAGE)
    tier.put(key(0), value_of(PAGE))
    tier.pin_many([key(0)], True)
    tier.put(key(0), value_of(PAGE))
    assert tier.stats().num_pinned == 1


def test_entry_being_sent_is_not_overwritten() -> None:
    tier = DramTier(2 * PAGE)
    original = value_of(PAGE)
    tier.put(key(0), original)
    (entry,) = tier.acquire_many([key(0)])
    assert entry is not None
    view = tier.view(entry)
    tier.put(key(1), value_of(PAGE))
    slot = tier.reserve(key(2), PAGE)  # full: must evict key(1), never the entry being sent
    assert slot is not None and not tier.contains(key(1)) and tier.contains(key(0))
    slot.release()
    assert tier.delete(key(0))  # deleted while being sent: memory stays until released
    for i in range(3, 6):
        tier.put(key(i), value_of(PAGE))
    assert bytes(view) == original
    tier.release(entry)
    assert tier.arena.allocated_bytes <= 2 * PAGE


def put_as(tier: DramTier, tenant: str | None, i: int) -> bool:
    slot = tier.reserve(key(i), PAGE, tenant)
    if slot is None:
        return False
    slot.view[:] = value_of(PAGE)
    return tier.commit([slot])[0] is not None


def test_a_tenant_over_its_quota_evicts_its_own_least_recent_chunks_only() -> None:
    tier = DramTier(16 * PAGE)
    tier.tenants.quotas = {"a": 2 * PAGE}
    assert put_as(tier, "b", 0) and put_as(tier, None, 1)  # "b" has no quota, nobody neither
    assert put_as(tier, "a", 2) and put_as(tier, "a", 3)
    assert tier.get(key(2)) is not None  # 3 is now a's least recent
    assert put_as(tier, "a", 4)  # room for it: a's own 3 goes, nobody else's
    assert [tier.contains(key(i)) for i in range(5)] == [True, True, True, False, True]
    assert tier.tenants.used == {"a": 2 * PAGE, "b": PAGE}
    assert (tier.tenants.evictions, tier.tenants.rejections) == (1, 0)
    assert tier.reserve(key(5), 3 * PAGE, "a") is None  # over the whole quota: refused
    assert tier.tenants.rejections == 1 and tier.contains(key(2)) and tier.contains(key(4))
    (entry,) = tier.acquire_many([key(2)])
    (other,) = tier.acquire_many([key(4)])
    assert tier.reserve(key(6), PAGE, "a") is None  # its chunks are being read: none can go
    assert entry is not None and other is not None
    tier.release(entry)
    tier.release(other)
    assert tier.delete(key(2)) and tier.tenants.used == {"a": PAGE, "b": PAGE}


def test_value_larger_than_capacity() -> None:
    tier = DramTier(2 * PAGE)
    assert tier.reserve(key(0), 3 * PAGE) is None


def test_ttl_expiry_with_injected_clock() -> None:
    clock = FakeClock()
    tier = DramTier(8 * PAGE, clock=clock, default_ttl_s=100)
    tier.put(key(0), value_of(PAGE))
    slot = tier.reserve(key(1), PAGE)
    assert slot is not None
    slot.view[:] = value_of(PAGE)
    tier.commit([slot], ttl_s=[5.0])
    clock.now += 6
    assert not tier.contains(key(1)) and tier.contains(key(0))
    clock.now += 100
    assert tier.expire() == 1
    assert tier.stats().num_objects == 0 and tier.stats().expirations == 2
    assert tier.arena.allocated_bytes == 0


def test_contains_many_sees_a_ttl_run_out() -> None:
    """A batch check (EXISTS, LOOKUP) answers from the index alone while no TTL is due,
    and finds (and drops) an entry whose TTL ran out once one is."""
    clock = FakeClock()
    tier = DramTier(8 * PAGE, clock=clock)
    tier.put(key(0), value_of(PAGE))
    slot = tier.reserve(key(1), PAGE)
    assert slot is not None
    slot.view[:] = value_of(PAGE)
    tier.commit([slot], ttl_s=[5.0])
    assert tier.contains_many([key(0), key(1), key(2)]) == [True, True, False]
    clock.now += 6
    assert tier.contains_many([key(1), key(0)]) == [False, True]
    assert tier.stats().num_objects == 1 and tier.stats().expirations == 1


def test_released_reservation_frees_memory() -> None:
    tier = DramTier(4 * PAGE)
    slot = tier.reserve(key(0), 3 * PAGE)
    assert slot is not None and tier.arena.allocated_bytes == 3 * PAGE
    slot.release()
    slot.release()  # idempotent
    assert tier.arena.allocated_bytes == 0


def test_invalid_envelope_rejected_on_commit() -> None:
    tier = DramTier(4 * PAGE)
    slot = tier.reserve(key(0), PAGE)
    assert slot is not None
    slot.view[:] = b"\0" * PAGE
    assert tier.commit([slot]) == [None]
    assert tier.arena.allocated_bytes == 0 and not tier.contains(key(0))


def test_lookup_counts_leading_keys() -> None:
    tier = DramTier(8 * PAGE)
    for i in (0, 1, 3):
        tier.put(key(i), value_of(100))
    assert tier.lookup([key(0), key(1), key(2), key(3)]) == 2
    assert tier.lookup([key(2)]) == 0
    assert tier.lookup([]) == 0


@pytest.mark.parametrize("n", [1, 7])
def test_capacity_is_respected(n: int) -> None:
    tier = DramTier(16 * PAGE)
    for i in range(100):
        assert tier.put(key(i), value_of(n * PAGE - 7))
        assert tier.arena.allocated_bytes <= 16 * PAGE
    assert tier.stats().num_objects == 16 // n


# -- room for a large value among small ones (tiers/room.py) ------------------------------


def small_values_read_at_random(pages: int) -> tuple[DramTier, list[bytes]]:
    """A full tier of one-page values, half of them read in random order: the LRU order
    has nothing to do with where values lie."""
    import random

    tier = DramTier(pages * PAGE)
    keys = [key(i) for i in range(pages)]
    value = value_of(PAGE)
    for k in keys:
        assert tier.put(k, value)
    for k in random.Random(7).sample(keys, pages // 2):
        assert tier.get(k) is not None
    return tier, keys


def test_a_large_value_among_small_ones_evicts_about_its_size_not_the_cache() -> None:
    """LRU victims scattered over the arena free no extent big enough until most of it is
    gone (the whole 64 MiB cache for a 1 MiB value, measured); the LRU phase is bounded
    by the value's extent, then room is made by place: at most twice its size goes."""
    tier, keys = small_values_read_at_random(256)
    slot = tier.reserve(key(1000), 32 * PAGE)
    assert slot is not None
    evicted = tier.stats().evictions
    assert 32 < evicted <= 64  # the LRU phase made no hole: by place it is
    assert sum(tier.contains(k) for k in keys) == 256 - evicted
    slot.view[:] = value_of(32 * PAGE)
    assert tier.commit([slot])[0] is not None
    assert tier.get(key(1000)) is not None


def test_room_by_place_never_takes_a_pinned_value_or_one_being_read() -> None:
    """Every 8th page pinned and every 8th (offset by 4) being read: no run of 8 free
    pages can be made, so an 8-page value is refused, none of those is evicted, and of
    the rest only the LRU victims within its budget (8 pages): no run of free and
    evictable pages is 8 wide, so LRU order alone, the last resort, is not tried (it
    had evicted every other value, then failed)."""
    tier, keys = small_values_read_at_random(64)
    entries = {k: tier._entries[k] for k in keys}
    pinned = [k for k in keys if entries[k].offset // PAGE % 8 == 0]
    read = [k for k in keys if entries[k].offset // PAGE % 8 == 4]
    assert tier.pin_many(pinned, True) == [True] * len(pinned)
    held = tier.acquire_many(read)
    assert tier.reserve(key(1000), 8 * PAGE) is None
    assert all(tier.contains(k) for k in pinned + read)
    assert tier.stats().evictions <= 8
    assert tier.stats().num_objects >= 64 - 8
    slot = tier.reserve(key(1001), 3 * PAGE)  # 3 pages fit between them
    assert slot is not None
    slot.release()
    for entry in held:
        assert entry is not None
        tier.release(entry)
    assert tier.reserve(key(1002), 8 * PAGE) is None  # the pins still split the arena
    tier.pin_many(pinned, False)
    assert tier.reserve(key(1003), 8 * PAGE) is not None


@pytest.mark.parametrize("blocker", ["reads", "writes"])
def test_a_value_no_eviction_can_fit_evicts_little_where_reads_or_writes_split_the_arena(
        blocker: str) -> None:
    """Nothing pinned, but every 8th page (offset 4) is being read, or is a slot being
    written: no run of 8 pages can be made, so an 8-page value is refused after the LRU
    victims within its budget. LRU order alone, the last resort, is not tried: it had
    evicted every other value of the tier, then failed all the same."""
    tier, keys = small_values_read_at_random(64)
    entries = {k: tier._entries[k] for k in keys}
    split = [k for k in keys if entries[k].offset // PAGE % 8 == 4]
    held = []
    slots = []
    if blocker == "reads":
        held = tier.acquire_many(split)
    else:  # the pages freed, then reserved again by values on their way in
        assert tier.delete_many(split) == [True] * len(split)
        for i in range(len(split)):
            slot = tier.reserve(key(2000 + i), PAGE)
            assert slot is not None and slot.offset // PAGE % 8 == 4
            slots.append(slot)
    assert tier.pinned_extents == 0
    assert tier.reserve(key(1000), 8 * PAGE) is None
    assert tier.stats().evictions <= 8
    assert tier.stats().num_objects >= 64 - 8 - (len(split) if blocker == "writes" else 0)
    for entry in held:
        assert entry is not None
        tier.release(entry)
    for slot in slots:
        slot.release()
    assert tier.reserve(key(1001), 8 * PAGE) is not None  # nothing splits it now


def _no_run_fits(tier: DramTier, nbytes: int) -> bool:
    """No run of free and evictable arena is wide enough for ``nbytes``: no eviction
    could have made the room."""
    return tier._places.widest(_evictable) < Arena.extent(nbytes)


@given(st.lists(st.tuples(st.sampled_from(["put", "get", "pin", "read", "done", "slot",
                                           "land"]),
                          st.integers(0, 40), st.integers(1, 12)), max_size=150))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_eviction_keeps_pins_readers_and_its_place_index(ops: list[tuple[str, int, int]]
                                                         ) -> None:
    """Random puts of 1-12 pages into 32, reads, pins, held reads and slots being written:
    a pinned or held value is never evicted, held bytes never change, a value is refused
    only where no eviction could make its room, and the index of where values lie
    matches the values."""
    tier = DramTier(32 * PAGE)
    held: list[tuple[object, bytes]] = []
    pinned: set[bytes] = set()
    slots: list[object] = []
    for op, i, pages in ops:
        k = key(i)
        if op == "put":  # over a pinned or held key too: the pin stays, the held bytes too
            if not tier.put(k, value_of(pages * PAGE)):
                assert _no_run_fits(tier, pages * PAGE)
        elif op == "slot":  # a value on its way in: its memory taken, not yet an entry
            slot = tier.reserve(key(100 + i), pages * PAGE)
            if slot is None:
                assert _no_run_fits(tier, pages * PAGE)
            else:
                slots.append(slot)
        elif op == "land" and slots:  # its frame completed (committed) or failed
            landing = slots.pop(0)
            if i % 2:
                landing.view[:] = value_of(landing.length)  # type: ignore[attr-defined]
                assert tier.commit([landing])[0] is not None  # type: ignore[list-item]
            else:
                landing.release()  # type: ignore[attr-defined]
        elif op == "get":
            tier.get(k)
        elif op == "pin" and tier.pin_many([k], True)[0]:
            pinned.add(k)
        elif op == "read":
            (entry,) = tier.acquire_many([k])
            if entry is not None:
                held.append((entry, bytes(tier.view(entry))))
        elif op == "done" and held:
            tier.release(held.pop(0)[0])  # type: ignore[arg-type]
        assert all(tier.contains(p) for p in pinned)
        for entry, data in held:
            assert bytes(tier.view(entry)) == data  # type: ignore[arg-type]
        assert tier.arena.allocated_bytes <= 32 * PAGE
        assert tier.pinned_extents == sum(Arena.extent(e.length)
                                          for e in tier._entries.values() if e.pinned)
        places = tier._places
        assert sorted(places._starts) == sorted(e.offset for e in tier._entries.values())
        assert all(places._starts[e.offset] is e for e in tier._entries.values())
        assert places.extents == sum(Arena.extent(e.length) for e in tier._entries.values())
        assert tier._reading == len(held)


def test_a_value_that_fits_only_once_blocked_holes_are_bypassed_is_still_stored() -> None:
    """The 50 coldest values each sit between two pinned ones, so no hole by place can be
    made around any of the 32 LRU victims tried; LRU order alone, the last resort, still
    makes room, past the pins."""
    tier = DramTier(128 * PAGE)
    for i in range(128):
        assert tier.put(key(i), value_of(PAGE))
    for i in range(0, 128, 2):  # the odd pages become the coldest
        tier.get(key(i))
    pins = [key(i) for i in range(0, 100, 2)]
    assert tier.pin_many(pins, True) == [True] * 50
    slot = tier.reserve(key(1000), 8 * PAGE)
    assert slot is not None and slot.offset >= 99 * PAGE  # beyond the last pin (page 98)
    assert all(tier.contains(k) for k in pins)
    assert tier.stats().evictions > 16  # more than the bound + a hole: LRU order went on


def test_the_tier_reports_what_it_let_go_of_by_itself() -> None:
    """Room made and TTLs passed reach the tier's event sink, with the entry; a delete
    (asked for) does not; a second owner cannot listen."""
    clock = FakeClock()
    tier = DramTier(2 * PAGE, clock=clock, policy="lru")
    heard: list[tuple[str, bytes, str, object]] = []

    class Owner:
        def dropped(self, tier: str, key: bytes, why: str, entry: object) -> None:
            heard.append((tier, key, why, entry))

    tier.events.listen(Owner())
    tier.put(key(0), value_of(PAGE))
    slot = tier.reserve(key(1), PAGE)
    assert slot is not None
    slot.view[:] = value_of(PAGE)
    tier.commit([slot], ttl_s=[5.0])
    tier.put(key(2), value_of(PAGE))  # room: key 0 goes
    tier.delete(key(2))
    clock.now += 6
    assert not tier.contains(key(1))
    assert [(t, k, w) for t, k, w, _ in heard] == [("dram", key(0), "room"),
                                                  ("dram", key(1), "ttl")]
    assert [getattr(e, "key", None) for *_, e in heard] == [key(0), key(1)]
    with pytest.raises(ValueError, match="already reports"):
        tier.events.listen(Owner())
