"""The SSD worker process with a real RocksDB, moving bytes through the shared arena."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvpool.protocol.envelope import Codec, seal
from kvpool.protocol.worker import SsdStatus, WorkerSettings
from kvpool.server.cold.ssd import SsdTier, SsdUnavailableError
from kvpool.tiers.dram import DramTier


def value_of(n: int, index: int = 0) -> bytes:
    payload = os.urandom(n)
    return seal(payload, chunk_index=index) + payload


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


async def write(ssd: SsdTier, dram: DramTier, k: bytes) -> bool:
    """Write-behind of a DRAM entry, holding it until the worker is done."""
    (entry,) = dram.acquire_many([k])
    assert entry is not None
    done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def finished(stored: bool) -> None:
        dram.release(entry)
        done.set_result(stored)

    assert ssd.write(k, entry.offset, entry.length, finished)
    return await done


@pytest.fixture
def dram() -> DramTier:
    return DramTier(8 << 20)


def ssd_for(dram: DramTier, path: Path, capacity: int = 4 << 20) -> SsdTier:
    return SsdTier(path, WorkerSettings(capacity, Codec.LZ4), arena_fd=dram.arena.fd,
                   arena_size=dram.arena.capacity, max_pending_bytes=16 << 20)


@pytest.fixture
async def ssd(dram: DramTier, tmp_path: Path) -> AsyncIterator[SsdTier]:
    tier = ssd_for(dram, tmp_path)
    await tier.start()
    yield tier
    await tier.stop()


async def test_write_then_read_through_the_arena(dram: DramTier, ssd: SsdTier) -> None:
    value = value_of(300_000)
    assert dram.put(key(1), value)
    assert await write(ssd, dram, key(1))
    assert ssd.index == {key(1): len(value)}
    slot = dram.reserve(key(1), len(value))
    assert slot is not None
    assert await ssd.read_into(key(1), slot.offset, len(value)) == SsdStatus.OK
    assert bytes(slot.view) == value
    slot.release()
    assert await ssd.read_into(key(2), 0, 10) == SsdStatus.MISS


async def test_index_survives_restart_and_tracks_evictions(dram: DramTier,
                                                          tmp_path: Path) -> None:
    ssd = ssd_for(dram, tmp_path, capacity=1 << 20)
    await ssd.start()
    for i in range(6):  # 6 x 300 KB of random bytes into a 1 MiB tier: 3 remain
        assert dram.put(key(i), value_of(300_000, i))
        assert await write(ssd, dram, key(i))
    assert sorted(ssd.index) == [key(3), key(4), key(5)]
    assert ssd.counters.evicted == 3
    await ssd.stop()
    again = ssd_for(dram, tmp_path, capacity=1 << 20)
    await again.start()
    assert sorted(again.index) == [key(3), key(4), key(5)]
    stats = await again.worker_stats()
    assert stats["num_objects"] == 3
    await again.stop()


async def test_worker_death_is_reported(dram: DramTier, ssd: SsdTier) -> None:
    assert ssd._worker.proc is not None
    os.kill(ssd._worker.proc.pid, signal.SIGKILL)
    await ssd._worker.proc.wait()
    with pytest.raises(SsdUnavailableError):
        await ssd.worker_stats()
    assert not ssd.up


async def test_second_worker_on_same_dir_fails_clearly(dram: DramTier, ssd: SsdTier,
                                                       tmp_path: Path) -> None:
    other = ssd_for(dram, tmp_path)
    with pytest.raises(SsdUnavailableError, match="did not start"):
        await other.start()


async def test_write_behind_sheds_past_its_budget(dram: DramTier, tmp_path: Path) -> None:
    ssd = SsdTier(tmp_path, WorkerSettings(8 << 20, Codec.LZ4), arena_fd=dram.arena.fd,
                  arena_size=dram.arena.capacity, max_pending_bytes=1 << 20)
    await ssd.start()
    results: list[bool] = []
    all_done = asyncio.Event()

    def finished(stored: bool) -> None:
        results.append(stored)
        if len(results) == 3:
            all_done.set()

    accepted = 0
    for i in range(6):
        dram.put(key(i), value_of(300_000))
        (entry,) = dram.acquire_many([key(i)])
        assert entry is not None
        accepted += ssd.write(key(i), entry.offset, entry.length, finished)
    assert accepted == 3 and ssd.counters.shed == 3  # 3 x 300 KB fit a 1 MiB budget
    await asyncio.wait_for(all_done.wait(), 30)
    assert results == [True] * 3 and ssd.counters.pending_write_bytes == 0
    await ssd.stop()


def test_worker_bounds_fetched_values_and_queued_fetches(
        tmp_path: Path, s3_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from kvpool.protocol.worker import SsdOp
    from kvpool.server.cold import ssd_worker
    from kvpool.tiers.rocksdb import RocksDbTier
    from kvpool.tiers.s3 import S3Tier

    monkeypatch.setattr(ssd_worker, "MAX_STAGED_BYTES", 1 << 20)
    monkeypatch.setattr(ssd_worker, "MAX_FETCHES", 0)
    s3 = S3Tier(s3_bucket, endpoint_url=s3_endpoint, region="us-east-1")
    for i in range(4):
        assert s3.put(key(i), value_of(400_000))
    worker = ssd_worker.Worker(RocksDbTier(tmp_path, 1 << 20), memoryview(bytearray(16)),
                               s3=s3)
    node_end, worker_end = socket.socketpair()
    worker._sock = worker_end
    for i in range(4):  # fetched, never copied: the oldest are dropped past 1 MiB
        worker._fetch_one(i, key(i))
    assert worker._staged_bytes <= 1 << 20 and len(worker._staged) == 2
    assert list(worker._staged) == [key(2), key(3)]
    # with no room for another FETCH, it is answered MISS at once instead of queued
    assert worker.handle(9, SsdOp.FETCH, key(0), 0, 0) == (SsdStatus.MISS, b"")
    assert worker.fetch_shed == 1
    node_end.close()
    worker_end.close()


def test_s3_ops_on_one_key_land_in_the_order_the_node_sent_them(
        tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    """A DELETE (and a FETCH) queued behind a slow write-behind upload of the same key wait
    for it: else the upload lands after the delete and the chunk is back in S3."""
    import socket
    import threading

    from kvpool.protocol.worker import REPLY, SsdOp
    from kvpool.server.cold import ssd_worker
    from kvpool.tiers.rocksdb import RocksDbTier
    from kvpool.tiers.s3 import S3Tier

    s3 = S3Tier(s3_bucket, endpoint_url=s3_endpoint, region="us-east-1")
    value = value_of(300_000)
    worker = ssd_worker.Worker(RocksDbTier(tmp_path, 4 << 20), memoryview(bytearray(value)),
                               s3=s3)
    node_end, worker_end = socket.socketpair()
    worker._sock = worker_end
    gate = threading.Event()
    real_put = s3.put

    def slow_put(k: bytes, v: bytes | bytearray | memoryview) -> bool:
        gate.wait(30)  # a slow S3 upload, still in flight when the DELETE comes
        return real_put(k, v)

    s3.put = slow_put  # type: ignore[method-assign]
    try:
        assert worker.handle(1, SsdOp.PUT, key(1), 0, len(value)) == (SsdStatus.OK, b"")
        assert worker.handle(2, SsdOp.DELETE, key(1), 0, 0) == (SsdStatus.OK, b"")
        assert worker.handle(3, SsdOp.FETCH, key(1), 0, 0) is None  # answered from the pool
        gate.set()
        node_end.settimeout(30)
        request_id, status, _ = REPLY.unpack(node_end.recv(REPLY.size, socket.MSG_WAITALL))
        assert (request_id, status) == (3, SsdStatus.MISS)
        assert S3Tier(s3_bucket, endpoint_url=s3_endpoint, region="us-east-1").get(key(1)) \
            is None
    finally:
        gate.set()
        worker._pool.shutdown(drop_queued=False)
        node_end.close()
        worker_end.close()


def test_s3_log_is_read_in_order_and_forgets_what_the_node_applied(tmp_path: Path) -> None:
    """S3_KEYS from record ``offset`` on: the records before it are dropped (the log would
    otherwise grow with every upload and delete the worker ever saw)."""
    from kvpool.protocol.worker import S3_CHANGE, S3Change, SsdOp
    from kvpool.server.cold import ssd_worker
    from kvpool.tiers.rocksdb import RocksDbTier

    worker = ssd_worker.Worker(RocksDbTier(tmp_path, 4 << 20), memoryview(bytearray(64)))

    def read(offset: int) -> list[tuple[bytes, int]]:
        reply = worker.handle(1, SsdOp.S3_KEYS, bytes(16), offset, 0)
        assert reply is not None and reply[0] == SsdStatus.OK
        return list(S3_CHANGE.iter_unpack(reply[1]))

    worker.s3_log.log(key(1), S3Change.PRESENT)
    worker.s3_log.log(key(1), S3Change.PRESENT)  # no change: not logged again
    worker.s3_log.log(key(2), S3Change.GONE)  # never logged present: nothing to take back
    worker.s3_log.log(key(1), S3Change.DELETED)
    worker.s3_log.log(key(2), S3Change.DELETED)  # one record per DELETE, logged or not
    assert read(0) == [(key(1), S3Change.PRESENT), (key(1), S3Change.DELETED),
                       (key(2), S3Change.DELETED)]
    worker.s3_log.log(key(1), S3Change.PRESENT)  # written again after its delete
    assert read(3) == [(key(1), S3Change.PRESENT)]
    assert len(worker.s3_log.records) == 1  # the 3 records the node applied are gone
    assert read(4) == [] and worker.s3_log.records == []


def test_the_nodes_s3_mirror_skips_an_upload_logged_before_its_pending_delete() -> None:
    """The node's side of that log: until the worker logs a DELETE the node sent, a
    PRESENT record of the key is from before it (stale); one after it counts again."""
    from kvpool.protocol.worker import S3_CHANGE, S3Change
    from kvpool.server.cold.s3_mirror import S3KeyMirror

    def log(*records: tuple[int, int]) -> bytes:
        return b"".join(S3_CHANGE.pack(key(i), change) for i, change in records)

    mirror = S3KeyMirror()
    assert mirror.apply(log((1, S3Change.PRESENT), (2, S3Change.PRESENT))) == 2
    assert key(1) in mirror and len(mirror) == 2
    mirror.deleting(key(1))
    mirror.deleting(key(1))  # two DELETEs in flight: two DELETED records to come
    assert key(1) not in mirror
    mirror.apply(log((1, S3Change.PRESENT), (1, S3Change.DELETED), (1, S3Change.PRESENT)))
    assert key(1) not in mirror  # the second DELETE is still ahead of that upload
    mirror.apply(log((1, S3Change.DELETED), (1, S3Change.PRESENT), (2, S3Change.GONE)))
    assert key(1) in mirror and key(2) not in mirror  # uploaded again after both deletes
    assert mirror.log_pos == 8


def test_worker_settings_travel_whole_and_garbage_is_refused() -> None:
    """What the node sends the worker on its stdin: every field comes back as sent (the
    codecs as Codec, S3 or none), and anything else is a ConfigError, not a half-set tier."""
    from kvpool.protocol.errors import ConfigError
    from kvpool.protocol.worker import S3Settings, TieringPolicy

    for settings in (WorkerSettings(1 << 30),
                     WorkerSettings(0, policy=TieringPolicy(ssd=False, s3=True,
                                                            write_through=True),
                                    s3=S3Settings("alone")),
                     WorkerSettings(5 << 20, Codec.RAW, write_buffer_bytes=4 << 20, nice=0,
                                    no_dumps=True,
                                    s3=S3Settings("b", prefix="p", endpoint_url="http://x:1",
                                                  region="r", codec=Codec.SHUFFLE_LZ4,
                                                  max_pending_bytes=3 << 20,
                                                  relist_interval_s=7.5))):
        again = WorkerSettings.decode(settings.encode())
        assert again == settings
        assert isinstance(again.codec, Codec)
    policy = b'"policy": {"ssd": true, "s3": false, "write_through": false}'
    for garbage in (b"", b"[]", b'{"capacity_bytes": 1}', b'{"capacity_bytes": 1, "codec": 9, '
                    b'"write_buffer_bytes": null, "nice": 5, "no_dumps": false, "s3": null, '
                    + policy + b"}",
                    b'{"capacity_bytes": 1, "codec": 1, "write_buffer_bytes": null, "nice": 5, '
                    b'"no_dumps": false, "s3": null, "policy": {"ssd": true, "disk": 1}}'):
        with pytest.raises(ConfigError):
            WorkerSettings.decode(garbage)
