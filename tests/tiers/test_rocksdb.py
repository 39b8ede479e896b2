"""SSD tier specifics: restart, codecs on disk, corruption, eviction order."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE, Codec
from kvpool.tiers.rocksdb import RocksDbTier
from tests.kvdata import key, kv_envelope


def kv_chunk(index: int = 0) -> bytes:
    return kv_envelope(40_000, index)


def test_restart_serves_what_was_on_disk(tmp_path: Path) -> None:
    tier = RocksDbTier(tmp_path, 10 << 20)
    values = {key(i): kv_chunk(i) for i in range(20)}
    for k, v in values.items():
        assert tier.put(k, v)
    used = tier.stats().used_bytes
    tier.close()
    reopened = RocksDbTier(tmp_path, 10 << 20)
    assert reopened.stats().num_objects == 20 and reopened.stats().used_bytes == used
    for k, v in values.items():
        assert reopened.get(k) == v
    reopened.close()


def test_eviction_order_survives_restart(tmp_path: Path) -> None:
    clock = iter(range(1000, 2000))
    size = len(kv_chunk())
    tier = RocksDbTier(tmp_path, 3 * size, codec=Codec.RAW, clock=lambda: next(clock))
    for i in range(3):
        tier.put(key(i), kv_chunk(i))
    tier.close()
    tier = RocksDbTier(tmp_path, 3 * size, codec=Codec.RAW, clock=lambda: next(clock))
    tier.put(key(9), kv_chunk(9))  # evicts the oldest write, key 0
    assert [tier.contains(key(i)) for i in range(3)] == [False, True, True]
    tier.close()


@pytest.mark.parametrize("codec", list(Codec))
def test_codec_on_disk(tmp_path: Path, codec: Codec) -> None:
    tier = RocksDbTier(tmp_path, 10 << 20, codec=codec)
    value = kv_chunk()
    tier.put(key(1), value)
    stored = tier._db.get(key(1))
    if codec is Codec.SHUFFLE_LZ4:
        assert len(stored) < 0.9 * len(value)
    assert tier.get(key(1)) == value  # always handed back RAW, checksum verified
    tier.close()


def test_flipped_byte_on_disk_is_a_miss_and_dropped(tmp_path: Path) -> None:
    tier = RocksDbTier(tmp_path, 10 << 20, codec=Codec.RAW)
    tier.put(key(1), kv_chunk())
    stored = bytearray(tier._db.get(key(1)))
    stored[ENVELOPE_HEADER_SIZE + 1234] ^= 0x40
    tier._db.put(key(1), bytes(stored))  # corrupt it under the tier, as a disk would
    assert tier.get(key(1)) is None
    assert tier.num_corrupt == 1 and not tier.contains(key(1))
    tier.close()
    assert not RocksDbTier(tmp_path, 10 << 20).contains(key(1))


def test_rejects_non_envelope(tmp_path: Path) -> None:
    tier = RocksDbTier(tmp_path, 1 << 20)
    assert not tier.put(key(1), os.urandom(100))
    tier.close()
