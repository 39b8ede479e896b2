"""The arena index on its own: what the node's writer publishes, the client's reader finds
(through a second, read-only mapping of the same memory file), and what it refuses: slots
caught mid-write, expired values, full sets, a retired index, an unknown layout."""

from __future__ import annotations

import itertools
import os
import sys
import time

import pytest

from kvpool.client._shm import ShmIndex
from kvpool.protocol.envelope import Codec, EnvelopeHeader, seal
from kvpool.protocol.errors import KvpoolConnectionError
from kvpool.protocol.shm_index import HEADER_SIZE, SLOT_SIZE, WAYS, IndexSlot, set_of
from kvpool.tiers.arena import ALIGN
from kvpool.tiers.arena_index import ArenaIndex
from kvpool.tiers.dram import DramTier

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _reader(index: ArenaIndex) -> ShmIndex:
    fd = os.open(f"/proc/self/fd/{index.fd}", os.O_RDONLY)
    return ShmIndex(fd, index.file_size)


def _value(payload: bytes) -> bytes:
    return seal(payload) + payload


def _slot(key: bytes, offset: int = 4096, expires: float = 0.0) -> IndexSlot:
    return IndexSlot(key, offset, 1000, 7, 0xDEADBEEF, expires)


def test_published_slots_are_found_and_withdrawn_ones_are_not() -> None:
    index = ArenaIndex(64 << 20)
    reader = _reader(index)
    try:
        keys = [os.urandom(16) for _ in range(100)]
        for i, key in enumerate(keys):
            assert index.publish(_slot(key, offset=i * ALIGN))
        assert [reader.find(k) for k in keys] == [_slot(k, offset=i * ALIGN)
                                                  for i, k in enumerate(keys)]
        assert reader.find(os.urandom(16)) is None
        index.publish(_slot(keys[0], offset=99 * ALIGN))  # rewritten in place
        assert reader.find(keys[0]) == _slot(keys[0], offset=99 * ALIGN)
        assert len(index) == 100
        for key in keys[::2]:
            index.withdraw(key)
        assert [reader.find(k) is not None for k in keys] == [i % 2 == 1 for i in range(100)]
        assert (index.counters.published, index.counters.withdrawn) == (101, 50)
        assert reader.epoch == 0
        index.set_epoch(7)  # a cluster node's map: clients on another epoch ask GET_SHM
        assert reader.epoch == 7
    finally:
        reader.close()
        index.close()


def test_a_full_set_publishes_nothing_until_a_way_frees() -> None:
    index = ArenaIndex(1 << 20)
    reader = _reader(index)
    try:
        same = list(itertools.islice((k for k in (i.to_bytes(16, "little")
                                                   for i in itertools.count())
                                      if set_of(k, index.sets) == 3), WAYS + 1))
        assert all(index.publish(_slot(k)) for k in same[:WAYS])
        assert not index.publish(_slot(same[WAYS]))
        assert index.counters.set_full == 1 and reader.find(same[WAYS]) is None
        index.withdraw(same[2])
        assert index.publish(_slot(same[WAYS]))
        assert reader.find(same[WAYS]) == _slot(same[WAYS])
    finally:
        reader.close()
        index.close()


def test_a_slot_caught_mid_write_or_expired_is_not_trusted() -> None:
    index = ArenaIndex(1 << 20)
    reader = _reader(index)
    try:
        torn, old, fresh = os.urandom(16), os.urandom(16), os.urandom(16)
        index.publish(_slot(torn))
        index.publish(_slot(old, expires=time.time() - 1))
        index.publish(_slot(fresh, expires=time.time() + 60))
        assert reader.find(torn) is not None
        # half a rewrite: the offset of another value, the rest (and check) of this one
        pos = index._where[torn]
        index._view[pos + 16 : pos + 24] = (12345 * ALIGN).to_bytes(8, "little")
        assert reader.find(torn) is None
        assert reader.find(old) is None and reader.find(fresh) is not None
        index.retire()  # the node stops: nothing is found any more
        assert reader.find(fresh) is None
    finally:
        reader.close()
        index.close()


def test_an_unknown_layout_is_refused() -> None:
    index = ArenaIndex(1 << 20)
    try:
        index._view[:8] = b"NOTKVIDX"
        with pytest.raises(KvpoolConnectionError, match="unknown layout"):
            _reader(index)
        fd = os.open(f"/proc/self/fd/{index.fd}", os.O_RDONLY)
        with pytest.raises(KvpoolConnectionError):  # a file shorter than its header says
            ShmIndex(fd, HEADER_SIZE + SLOT_SIZE)
    finally:
        index.close()


def test_the_dram_tier_keeps_its_index_true() -> None:
    """Published on store (those stored before the index too), moved on overwrite,
    withdrawn on delete and eviction -- before the extent is freed, whose generation
    then moves on; a read through the index is counted by touch_many, never held."""
    tier = DramTier(4 * ALIGN * 4)
    try:
        first = os.urandom(16)
        assert tier.put(first, _value(b"a" * 5000))
        index = ArenaIndex(tier.arena.capacity)
        tier.attach_index(index)
        reader = _reader(index)
        slot = reader.find(first)
        entry = tier.peek(first)
        assert entry is not None and slot is not None
        assert (slot.offset, slot.length, slot.checksum) == (entry.offset, entry.length,
                                                              entry.checksum)
        assert slot.generation == tier.arena.gens[entry.offset // ALIGN]
        assert tier.put(first, _value(b"b" * 5000))  # overwritten: a new extent
        moved = reader.find(first)
        assert moved is not None and moved.checksum != slot.checksum
        assert tier.arena.gens[slot.offset // ALIGN] != slot.generation  # old extent freed
        hits = tier.stats().hits
        (touched,) = tier.touch_many([first])
        assert touched is not None and touched.readers == 0 and tier.stats().hits == hits + 1
        tier.delete(first)
        assert reader.find(first) is None
        keys = [os.urandom(16) for _ in range(12)]  # 12 x 2 pages into a 16-page arena
        for key in keys:
            assert tier.put(key, _value(b"c" * 5000))
        assert tier.stats().evictions > 0
        assert [reader.find(k) is not None for k in keys] == [tier.contains(k) for k in keys]
        # a compressed value (the client would copy its bytes as the payload) is not published
        packed = os.urandom(16)
        lz4 = EnvelopeHeader(raw_len=9000, stored_len=100, checksum=1, codec=Codec.LZ4).pack()
        assert tier.put(packed, lz4 + bytes(100))
        assert tier.contains(packed) and reader.find(packed) is None
        reader.close()
    finally:
        tier.close()
