"""The same-host fast path against real node processes: identical bytes to TCP, values freed
mid-read never returned torn (forced with the client's after-hash and after-copy hooks),
users without permission on TCP, leases that end when a client dies or stalls; reads
through the arena index (no request; counted and kept recent by TOUCH; TTLs; a stopped
node's index retired); PUT through the arena the same way (identical bytes, uncommitted
slots given back, no write grant: TCP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.client import AsyncClient, Client
from kvpool.client import _shm as shm_module
from kvpool.client._options import SHM_PUT_MIN_BYTES
from kvpool.client._shm import ShmMapping
from kvpool.client._shm_path import TOUCH_DELAY_S
from kvpool.protocol import pages
from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE, open_envelope
from kvpool.protocol.errors import KvpoolConnectionError
from kvpool.protocol.frames import ShmItem
from kvpool.protocol.shm_index import WAYS, index_sets, set_of
from kvpool.tiers.arena import Arena
from tests.conftest import NodeProcess, http_json, node_stats, shm_node, start_node

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _mapping(client: Client) -> ShmMapping:
    mapping = shm_node(client).path.mapping
    assert mapping is not None
    return mapping


def _shm_stats(node: NodeProcess) -> dict[str, int]:
    shm: dict[str, int] = node_stats(node)["shm"]
    return shm


@pytest.fixture(params=["all", "one"], ids=["all-cpus", "one-cpu"])
def cpus(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The test's thread may run on every CPU, or on one only (as vLLM binds its CPU
    worker): then no helper thread copies, and copies of up to a block hold the GIL."""
    if request.param == "all":
        yield "all"
        return
    before = os.sched_getaffinity(0)

    def no_helpers() -> Any:
        raise AssertionError("a helper thread was asked to copy on one CPU")

    monkeypatch.setattr(shm_module, "_copy_pool", no_helpers)
    os.sched_setaffinity(0, {min(before)})  # this thread only
    try:
        yield "one"
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.parametrize("index", [True, False], ids=["index", "leased"])
def test_fast_path_returns_the_same_bytes_as_tcp(index: bool, cpus: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    copied: list[int] = []
    numpy_copy = shm_module.np.copyto

    def count(dst: Any, src: Any) -> None:
        copied.append(src.nbytes)
        numpy_copy(dst, src)

    monkeypatch.setattr(shm_module.np, "copyto", count)
    node = start_node("--dram-capacity", "128MiB", "--no-ssd")
    try:
        sizes = [1, 100, 4095, 4096, 4097, 65536, 1 << 20, (4 << 20) + 3]
        keys = [os.urandom(16) for _ in sizes]
        values = [os.urandom(n) for n in sizes]
        with Client(node.url, shm=True, shm_index=index) as fast, \
                Client(node.url, shm=False) as tcp:
            fast.put_many(keys, values)
            missing = os.urandom(16)
            assert fast.get_many([*keys, missing]) == [*values, None]
            assert tcp.get_many(keys) == values
            # into caller buffers, and scattered over several (readv style)
            bufs = [bytearray(n + 10) for n in sizes]
            assert fast.get_many_into(keys, bufs) == sizes
            assert [bytes(b[:n]) for b, n in zip(bufs, sizes, strict=True)] == values
            parts = [bytearray(3 << 20), bytearray(2 << 20)]
            assert fast.get_into(keys[-1], parts) == sizes[-1]
            assert bytes(parts[0] + parts[1])[: sizes[-1]] == values[-1]
            # a MiB into segments of a few hundred KiB (a vLLM engine-format load's shape):
            # on one CPU copied with no numpy call
            del copied[:]
            parts = [bytearray(300 << 10), bytearray(724 << 10)]
            assert fast.get_into(keys[-2], parts) == 1 << 20
            assert bytes(parts[0] + parts[1]) == values[-2]
            alone = shm_module.one_cpu()  # (also with "all" on a one-CPU machine)
            assert alone or cpus == "all"
            assert copied == ([] if alone else [300 << 10, 724 << 10])
            assert fast.bytes_by_path["tcp"] == 0
            assert fast.bytes_by_path["shm"] == 2 * sum(sizes) + sizes[-1] + sizes[-2]
            assert tcp.bytes_by_path == {"shm": 0, "tcp": sum(sizes)}
            assert fast.async_client.shm_index_hits == (2 * len(sizes) + 2 if index else 0)
        shm = _shm_stats(node)  # the client's close reported its reads through the index
        assert shm["grants"] >= 1 and shm["released"] == shm["leases"] and shm["expired"] == 0
        assert shm["open_leases"] == 0
        stored = sum(ENVELOPE_HEADER_SIZE + n for n in sizes)
        # read twice, the last two three times; the missing key was asked with GET_SHM
        assert shm["index_bytes_out"] == (2 * stored + 2 * ENVELOPE_HEADER_SIZE + sizes[-1]
                                          + sizes[-2] if index else 0)
        assert shm["leases"] == (0 if index else 4)
        assert shm["index"]["entries"] == len(sizes)
    finally:
        assert node.stop() == 0


def _overwrite_in_thread(url: str, key: bytes, size: int, replace_key: bool) -> bytes:
    """From another client (thread): free ``key``'s extent and fill the arena anew."""
    new = os.urandom(size)

    def work() -> None:
        with Client(url, shm=False) as other:
            if replace_key:
                other.delete(key)
                other.put_many([os.urandom(16) for _ in range(8)], [new] * 8)  # reuse the pages
            else:
                other.delete(key)
                other.put(key, new)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(30)
    return new


def _overwrite_during_read(fast: Client, url: str, key: bytes, replace_key: bool, *,
                           wait_s: float = 0.0, hook: str = "after_copy") -> list[bytes]:
    """Hook the client's next read (``hook``: after the copy, or ``"after_hash"``: between
    the hash of the value's first block and its copy): then (and after ``wait_s``) free
    ``key``'s extent from another client; the list gets the new value once the hook ran."""
    mapping = _mapping(fast)
    new: list[bytes] = []

    def overwrite(item: ShmItem) -> None:
        setattr(mapping, hook, None)  # once
        time.sleep(wait_s)
        new.append(_overwrite_in_thread(url, key, 1 << 20, replace_key))
        assert mapping.gens[item.offset // 4096] != item.generation

    setattr(mapping, hook, overwrite)
    return new


@pytest.mark.parametrize("replace_key", [True, False], ids=["deleted", "rewritten"])
def test_a_value_freed_mid_copy_is_never_returned_torn(replace_key: bool) -> None:
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--shm-lease", "0.2")
    try:
        key, old = os.urandom(16), os.urandom(1 << 20)
        with Client(node.url, shm=True, shm_index=False) as fast:
            fast.put(key, old)
            # the lease (0.2 s) ends before the overwrite; the node may free the value
            new = _overwrite_during_read(fast, node.url, key, replace_key, wait_s=0.6)
            got = fast.get(key)
            assert new, "the hook ran"
            # the copy was made while the value was being freed: retried over TCP
            assert fast.async_client.shm_retries == 1
            assert got == (None if replace_key else new[0])
            assert fast.bytes_by_path["tcp"] == (0 if replace_key else 1 << 20)
        assert _shm_stats(node)["expired"] == 1
    finally:
        assert node.stop() == 0


@pytest.mark.parametrize("replace_key", [True, False], ids=["deleted", "rewritten"])
def test_a_value_freed_while_copied_through_the_index_is_never_returned_torn(
        replace_key: bool) -> None:
    """No lease holds a value read through the index: the node frees it at once; the
    client's generation check sees that and asks again, over TCP (the sync client asks
    for what the index lacks or had stale in its own thread)."""
    node = start_node("--dram-capacity", "16MiB", "--no-ssd")
    try:
        key, old = os.urandom(16), os.urandom(1 << 20)
        with Client(node.url, shm=True) as fast:
            fast.put(key, old)
            new = _overwrite_during_read(fast, node.url, key, replace_key)
            got = fast.get(key)
            assert new, "the hook ran"
            node_client = fast.async_client._router.standalone_node
            assert node_client is not None
            assert got == (None if replace_key else new[0])
            # asked again over TCP: the new value (or nothing)
            path = node_client.path
            assert (path.index_stale, path.index_hits) == (1, 0)
            assert fast.bytes_by_path == {"shm": 0, "tcp": 0 if replace_key else 1 << 20}
        shm = _shm_stats(node)
        assert shm["leases"] == 0 and shm["index_items_out"] == 0
    finally:
        assert node.stop() == 0


def test_what_the_index_lacks_is_asked_over_tcp_in_the_callers_thread() -> None:
    """A same-host sync GET of keys the arena index cannot answer (a miss; a value whose
    index set was full) goes over TCP from the caller's thread, beside what the index has:
    one GET, no GET_SHM on the event loop (a lease and its release, 2-3x slower for values
    below ~256 KiB: bench.index_miss)."""
    capacity = 16 << 20
    sets = index_sets(capacity)
    node = start_node("--dram-capacity", str(capacity), "--no-ssd")
    try:
        same_set: list[bytes] = []
        while len(same_set) < WAYS + 1:
            key = os.urandom(16)
            if set_of(key, sets) == 0:
                same_set.append(key)
        values = [os.urandom(4096) for _ in same_set]
        with Client(node.url) as fast:
            fast.put_many(same_set, values)  # the ninth finds its set full
            assert node_stats(node)["shm"]["index"]["set_full"] == 1
            before = node_stats(node)["requests"]
            missing = os.urandom(16)
            assert fast.get_many([*same_set, missing]) == [*values, None]
            asked = node_stats(node)["requests"]
            assert asked.get("get", 0) - before.get("get", 0) == 1
            assert asked.get("get_shm", 0) == before.get("get_shm", 0)
            assert fast.bytes_by_path == {"shm": WAYS * 4096, "tcp": 4096}
    finally:
        assert node.stop() == 0


@pytest.mark.parametrize("hash_source", [True, False], ids=["hash-then-copy", "copy-then-hash"])
@pytest.mark.parametrize("into", [True, False], ids=["get_into", "get"])
def test_pages_reused_between_the_hash_and_the_copy_are_never_returned(
        hash_source: bool, into: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """On x86-64 a read hashes the value where it lies, then copies it: the arena's bytes
    are replaced by another value's in between (the hash saw the old ones, the copy reads
    new ones), and only the generation check stands between that copy and the caller.
    The other order (aarch64's) is checked the same way."""
    monkeypatch.setattr(shm_module, "HASH_SOURCE", hash_source)
    node = start_node("--dram-capacity", "16MiB", "--no-ssd")
    try:
        key, old = os.urandom(16), os.urandom(1 << 20)
        with Client(node.url, shm=True) as fast:
            fast.put(key, old)
            mapping = _mapping(fast)
            slot = mapping.index.find(key) if mapping.index is not None else None
            assert slot is not None
            new = _overwrite_during_read(fast, node.url, key, True, hook="after_hash")
            buf = bytearray(1 << 20)
            got = fast.get_into(key, buf) if into else fast.get(key)
            assert new, "the hook ran"
            payload = slot.offset + ENVELOPE_HEADER_SIZE
            # the old value's pages now hold another value's bytes (what a copy would read)
            assert mapping.view[payload : payload + (1 << 20)] == new[0]
            assert got is None  # deleted: the index read was stale, GET_SHM finds nothing
            node_client = fast.async_client._router.standalone_node
            assert node_client is not None
            assert (node_client.path.index_stale, node_client.path.index_hits) == (1, 0)
            assert fast.bytes_by_path == {"shm": 0, "tcp": 0}
    finally:
        assert node.stop() == 0


def test_reads_through_the_index_send_no_request_and_keep_values_recent() -> None:
    """An index read costs the node nothing until the client's TOUCH, which counts it
    (stats, bytes by path) and refreshes its recency: the value survives an eviction
    that takes an older-read one."""
    node = start_node("--dram-capacity", "8MiB", "--no-ssd")
    try:
        keys = [os.urandom(16) for _ in range(8)]
        values = [os.urandom(1 << 20) for _ in keys]
        with Client(node.url, shm=False) as tcp:
            tcp.put_many(keys[:7], values[:7])  # 7 extents of 1 MiB + 4 KiB: the arena is full
        with Client(node.url) as fast:
            before = node_stats(node)
            assert fast.get(keys[0]) == values[0]  # the oldest, read again
            assert node_stats(node)["requests"] == before["requests"]  # not a frame was sent
            # the client's own stats call reports its reads first: they are in its answer
            assert fast.stats()["hits"] == before["hits"] + 1
        after = node_stats(node)
        assert after["requests"].get("touch") == 1 and after["shm"]["index_items_out"] == 1
        assert after["tiers"]["dram"]["hits"] == before["tiers"]["dram"]["hits"] + 1
        with Client(node.url, shm=False) as tcp:
            tcp.put(keys[7], values[7])  # evicts the least recently used: keys[1], not [0]
            assert tcp.exists_many(keys) == [True, False, True, True, True, True, True, True]
    finally:
        assert node.stop() == 0


def test_index_reads_honour_ttls_and_deletes() -> None:
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--expire-interval", "60",
                      "--shm-lease", "60")
    try:
        short, kept = os.urandom(16), os.urandom(16)
        with Client(node.url) as fast:
            fast.put(short, b"s" * 5000, ttl=0.3)
            fast.put(kept, b"k" * 5000)
            assert fast.get_many([short, kept]) == [b"s" * 5000, b"k" * 5000]
            hits = fast.async_client.shm_index_hits
            assert hits == 2
            time.sleep(0.5)  # past the TTL; the node's sweep (60 s) has not run
            assert fast.get(short) is None
            assert fast.async_client.shm_index_hits == hits  # the index said: expired
            fast.delete(kept)
            assert fast.get(kept) is None
    finally:
        assert node.stop() == 0


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_an_ended_nodes_index_is_not_read(how: str) -> None:
    """The mapping outlives the node. A stopped node retires its index first; a killed
    one cannot, but the sync client runs its loop before an index read once it has not
    for TOUCH_DELAY_S (with no TOUCH due, only that check runs it) and hears the
    connection end. Either way the client asks the
    (gone) node instead of returning values frozen in the index."""
    node = start_node("--dram-capacity", "16MiB", "--no-ssd")
    try:
        key = os.urandom(16)
        with Client(node.url, timeout=2, connect_timeout=2) as fast:
            fast.put(key, b"v" * 5000)
            assert fast.get(key) == b"v" * 5000
            hits = fast.async_client.shm_index_hits
            fast.stats()  # reports the read: no TOUCH is due to run the loop for it later
            if how == "stopped":
                assert node.stop() == 0
            else:
                node.proc.kill()
                node.proc.wait(10)
                time.sleep(2 * TOUCH_DELAY_S)
            with pytest.raises(KvpoolConnectionError):
                fast.get(key)
            assert fast.async_client.shm_index_hits == hits
    finally:
        node.stop()


def _versioned(key: bytes, version: int, size: int) -> bytes:
    stamp = key + version.to_bytes(8, "little")
    return (stamp * (size // len(stamp) + 1))[:size]


def test_index_reads_racing_overwrites_deletes_and_evictions_return_only_stored_values(
        ) -> None:
    """A writer rewrites, deletes and (through a small arena) evicts a few keys as fast as
    it can while a reader reads them through the index: every value read is one that was
    stored under its key, whole. (Races for real, unlike the hook tests above: here ~5%
    of index reads came out stale and were asked again. With the generation check taken
    out, 3 runs in 3 returned a wrong value: a read hashes the value where it lies, then
    copies it; when reads hashed their copies, taking out both checks failed 1 run in 3.)"""
    node = start_node("--dram-capacity", "8MiB", "--no-ssd")
    try:
        keys = [os.urandom(16) for _ in range(6)]
        size = 1 << 20
        stop = threading.Event()
        written = {"n": 0}

        def writer() -> None:
            with Client(node.url) as w:  # puts through the arena too: the fastest reuse
                version = 0
                while not stop.is_set():
                    version += 1
                    key = keys[version % len(keys)]
                    if version % 7 == 0:
                        w.delete(key)
                    else:
                        w.put(key, _versioned(key, version, size))
                    written["n"] += 1

        thread = threading.Thread(target=writer)
        thread.start()
        reads = wrong = 0
        deadline = time.monotonic() + 3.0
        try:
            with Client(node.url) as reader:
                buf = bytearray(size)
                while time.monotonic() < deadline:
                    for key in keys:
                        n = reader.get_into(key, buf)
                        if n is None:
                            continue
                        reads += 1
                        version = int.from_bytes(buf[16:24], "little")
                        if n != size or bytes(buf) != _versioned(key, version, size):
                            wrong += 1
                hits = reader.async_client.shm_index_hits
        finally:
            stop.set()
            thread.join(30)
        assert written["n"] > 50 and reads > 50 and hits > 0
        assert wrong == 0
    finally:
        assert node.stop() == 0


def test_user_without_permission_gets_tcp() -> None:
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--shm-allow", "uid:4242424")
    try:
        key, value = os.urandom(16), os.urandom(5000)
        with Client(node.url) as auto:  # default: the fast path when granted, TCP otherwise
            auto.put(key, value)
            assert auto.get(key) == value
            assert auto.bytes_by_path == {"shm": 0, "tcp": 5000}
        with pytest.raises(KvpoolConnectionError, match="may not map the arena"), \
                Client(node.url, shm=True) as forced:
            forced.get(key)
        assert _shm_stats(node)["denied"] >= 2
        assert _shm_stats(node)["grants"] == 0
    finally:
        node.stop()


# started as root, it becomes ``uid`` once everything is imported (the interpreter here may
# lie where another user cannot read it); the arena is asked for after that
_OTHER_UID_CLIENT = """
import concurrent.futures.thread, encodings.idna, json, os, sys
import numpy, uvloop, xxhash
import kvpool.client._shm
from kvpool.client import Client
url, key, uid, big = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]), os.urandom(2 << 20)
c = Client(url, shm=True)
os.setgid(uid)
os.setuid(uid)
with c:
    value = c.get(key)
    c.put(os.urandom(16), big)
    print(json.dumps({"uid": os.getuid(), "got": len(value or b""), "get": c.bytes_by_path,
                      "put": c.put_bytes_by_path}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_an_allowed_other_uid_reads_through_shm_and_writes_over_tcp() -> None:
    """--shm-allow uid:N lets another user's client map the arena read-only: its GETs copy
    from shared memory, its PUTs go over TCP (writes are for the node's own uid only)."""
    nobody = 65534
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--shm-allow", f"uid:{nobody}")
    try:
        key, value = os.urandom(16), os.urandom(1 << 20)
        with Client(node.url, shm=False) as c:
            c.put(key, value)
        done = subprocess.run([sys.executable, "-c", _OTHER_UID_CLIENT, node.url, key.hex(),
                               str(nobody)], capture_output=True, text=True, timeout=60,
                              check=False)
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen == {"uid": nobody, "got": 1 << 20, "get": {"shm": 1 << 20, "tcp": 0},
                        "put": {"shm": 0, "tcp": 2 << 20}}
        stats = _shm_stats(node)
        assert stats["grants"] >= 1 and stats["write_grants"] == 0  # one per connection
    finally:
        assert node.stop() == 0


def test_no_shm_node_and_forced_tcp() -> None:
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--no-shm")
    try:
        with Client(node.url) as auto:
            auto.put(b"k" * 16, b"v" * 100)
            assert auto.get(b"k" * 16) == b"v" * 100
            assert auto.bytes_by_path["shm"] == 0
        with pytest.raises(KvpoolConnectionError, match="offers no shared-memory"), \
                Client(node.url, shm=True) as forced:
            forced.get(b"k" * 16)
        assert "shm" not in http_json(f"{node.admin_url}/v1/stats")[1]
    finally:
        node.stop()


def test_a_stalled_reader_loses_its_lease_and_eviction_goes_on() -> None:
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--shm-lease", "0.3")
    try:
        key, value = os.urandom(16), os.urandom(1 << 20)
        seen: dict[str, int] = {}
        with Client(node.url, shm=True, shm_index=False) as fast:  # GET_SHM: a lease
            fast.put(key, value)

            def stall(_item: ShmItem) -> None:
                seen.update(during=_shm_stats(node)["open_leases"])
                time.sleep(1.0)
                seen.update(after=_shm_stats(node)["open_leases"])
                # the value is no longer held: an eviction may take it
                seen.update(evicted=http_json(f"{node.admin_url}/v1/admin/evict", "POST",
                                              {"tier": "dram"})[1]["evicted"]["dram"])

            _mapping(fast).after_copy = stall
            got = fast.get(key)
        assert seen == {"during": 1, "after": 0, "evicted": 1}
        assert got is None  # freed mid-copy, and gone when asked again over TCP
        assert _shm_stats(node)["expired"] == 1
    finally:
        node.stop()


CRASH = """
import os, sys
from kvpool.client import Client
with Client(sys.argv[1], shm=True, shm_index=False) as c:
    c.async_client._router.standalone_node.path.mapping.after_copy = lambda item: os._exit(3)
    c.get(bytes.fromhex(sys.argv[2]))
"""


def test_a_crashed_client_leaves_no_lease() -> None:
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--shm-lease", "60")
    try:
        key = os.urandom(16)
        with Client(node.url, shm=False) as c:
            c.put(key, os.urandom(1 << 20))
        proc = subprocess.run([sys.executable, "-c", CRASH, node.url, key.hex()], timeout=60,
                              check=False)
        assert proc.returncode == 3  # died between the copy and RELEASE
        deadline = time.monotonic() + 10
        while _shm_stats(node)["open_leases"] and time.monotonic() < deadline:
            time.sleep(0.05)
        shm = _shm_stats(node)
        assert shm["leases"] == 1 and shm["open_leases"] == 0 and shm["expired"] == 0
    finally:
        node.stop()


async def test_async_client_uses_the_fast_path() -> None:
    node = start_node("--dram-capacity", "16MiB", "--no-ssd")
    try:
        async with AsyncClient(node.url) as client:
            await client.put(b"a" * 16, b"payload")
            assert await client.get(b"a" * 16) == b"payload"
            assert client.bytes_by_path == {"shm": 7, "tcp": 0}
            assert client.shm_index_hits == 1
    finally:
        node.stop()


# -- PUT through shared memory ----------------------------------------------------------------


def test_put_through_shared_memory_stores_the_same_bytes() -> None:
    node = start_node("--dram-capacity", "64MiB", "--no-ssd")
    try:
        # a call under SHM_PUT_MIN_BYTES in all goes over TCP (one round trip, not two)...
        small = [1, 4097, SHM_PUT_MIN_BYTES // 2]
        # ... a bigger one, small values included, through the arena
        mixed = [0, 4097, 65536, SHM_PUT_MIN_BYTES, (4 << 20) + 3]
        keys = [os.urandom(16) for _ in small + mixed]
        values = [os.urandom(n) for n in small + mixed]
        with Client(node.url) as fast, Client(node.url, shm=False) as tcp:
            fast.put_many(keys[:3], values[:3], chunk_indexes=range(3), num_tokens=256)
            assert fast.put_bytes_by_path == {"shm": 0, "tcp": sum(small)}
            fast.put_many(keys[3:], values[3:], chunk_indexes=range(3, 8), num_tokens=256)
            assert fast.put_bytes_by_path == {"shm": sum(mixed), "tcp": sum(small)}
            assert tcp.get_many(keys) == values
            assert fast.get_many(keys) == values
            # a value given as several buffers is stored as their concatenation
            parts = [values[6][:1000], memoryview(values[6])[1000:]]
            fast.put(keys[0], parts)
            assert tcp.get(keys[0]) == values[6]
            assert tcp.put_bytes_by_path == {"shm": 0, "tcp": 0}
        for i, key in enumerate(keys[1:], 1):  # the envelope the client wrote
            chunk = http_json(f"{node.admin_url}/v1/chunks/{key.hex()}")[1]
            assert (chunk["depth"], chunk["num_tokens"]) == (i, 256)
        stats = node_stats(node)
        shm = stats["shm"]
        # two PUT_SHM leases, and the slot the last put's COMMIT_AS held ahead (the first
        # put, 5 MiB, is over 1/16 of the arena: none ahead), given back at the close
        assert shm["write_grants"] >= 1 and shm["put_leases"] == 3 and shm["committed"] == 6
        assert shm["open_leases"] == 0 and shm["expired"] == 0
        assert shm["bytes_in"] == sum(mixed) + len(values[6]) + 6 * ENVELOPE_HEADER_SIZE
        assert stats["num_objects"] == 8 and stats["requests"]["put_shm"] == 2
        assert stats["requests"]["commit_as"] == 2 and stats["requests"]["commit"] == 0
    finally:
        assert node.stop() == 0


@pytest.mark.parametrize("refused", [False, True])
def test_slots_are_mapped_in_one_call_before_they_are_written(
        refused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    real = pages._madvise()
    if real is None:
        pytest.skip("no madvise here")
    calls: list[tuple[int, int, int]] = []

    def madvise(address: int, length: int, advice: int) -> int:
        calls.append((address, length, advice))
        return -1 if refused else real(address, length, advice)

    monkeypatch.setattr(pages, "_madvise", lambda: madvise)
    node = start_node("--dram-capacity", "64MiB", "--no-ssd")
    try:
        keys = [os.urandom(16) for _ in range(3)]
        values = [os.urandom(SHM_PUT_MIN_BYTES + 5), os.urandom(3 << 20), os.urandom(100)]
        with Client(node.url) as fast, Client(node.url, shm=False) as tcp:
            populator = _mapping(fast)._populator
            assert populator is not None
            base = populator._address
            fast.put(keys[0], values[0])
            fast.put_many(keys[1:], values[1:])
            assert fast.put_bytes_by_path == {"shm": sum(map(len, values)), "tcp": 0}
            assert tcp.get_many(keys) == values
        # one call a slot, of the whole slot (envelope header included) rounded out to whole
        # granules; none for a slot too small to be worth it; after a refusal, none at all
        granule = shm_module.POPULATE_GRANULE
        assert len(calls) == (1 if refused else 2)
        for (address, length, advice), value in zip(calls, values, strict=False):
            start = address - base
            assert advice == pages.MADV_POPULATE_WRITE
            assert start % granule == 0 and length % granule == 0
            assert length < len(value) + ENVELOPE_HEADER_SIZE + 2 * granule
    finally:
        assert node.stop() == 0


def test_slots_not_committed_in_time_are_given_back_and_the_put_goes_over_tcp() -> None:
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--shm-lease", "0.2")
    try:
        key, value = os.urandom(16), os.urandom(1 << 20)
        with Client(node.url, shm=True) as fast:
            mapping = _mapping(fast)
            write = mapping.write

            def slow_write(*args: Any, **kwargs: Any) -> None:
                write(*args, **kwargs)
                time.sleep(0.8)  # past the lease: the node takes the slot back

            mapping.write = slow_write  # type: ignore[method-assign]
            fast.put(key, value)
            assert fast.put_bytes_by_path == {"shm": 0, "tcp": 1 << 20}
            node_client = fast.async_client._router.standalone_node
            assert node_client is not None and node_client.path.shm_put_expired == 1
            assert fast.get(key) == value
        stats = node_stats(node)
        assert (stats["shm"]["expired"], stats["shm"]["committed"]) == (1, 0)
        # one copy stored; the expired slot's memory is free again
        assert stats["tiers"]["dram"]["allocated_bytes"] == (1 << 20) + 4096
    finally:
        assert node.stop() == 0


def test_without_write_permission_puts_go_over_tcp() -> None:
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--no-shm-write")
    try:
        key, value = os.urandom(16), os.urandom(1 << 20)
        with Client(node.url, shm=True) as fast:
            assert not _mapping(fast).writable
            fast.put(key, value)
            assert fast.get(key) == value
            assert fast.put_bytes_by_path == {"shm": 0, "tcp": 1 << 20}
            assert fast.bytes_by_path == {"shm": 1 << 20, "tcp": 0}
        shm = node_stats(node)["shm"]
        assert shm["grants"] >= 1 and shm["write_grants"] == 0 and shm["put_leases"] == 0
    finally:
        assert node.stop() == 0


CRASH_WRITER = """
import os, sys
from kvpool.client import Client
with Client(sys.argv[1], shm=True) as c:
    c.async_client._router.standalone_node.path.mapping.write = lambda *a, **k: os._exit(3)
    c.put(os.urandom(16), os.urandom(1 << 20))
"""


def test_a_crashed_writer_leaves_no_reserved_slots() -> None:
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--shm-lease", "60")
    try:
        proc = subprocess.run([sys.executable, "-c", CRASH_WRITER, node.url], timeout=60,
                              check=False)
        assert proc.returncode == 3  # died holding a reserved slot, before COMMIT
        deadline = time.monotonic() + 10
        while node_stats(node)["shm"]["open_leases"] and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = node_stats(node)
        shm = stats["shm"]
        # ended by the closed connection, long before the 60 s deadline
        assert (shm["put_leases"], shm["committed"], shm["open_leases"], shm["expired"]) == (
            1, 0, 0, 0)
        assert stats["tiers"]["dram"]["allocated_bytes"] == 0 and stats["num_objects"] == 0
    finally:
        assert node.stop() == 0


def test_a_writable_mapping_populates_each_granule_once(monkeypatch: pytest.MonkeyPatch) -> None:
    real = pages._madvise()
    if real is None:
        pytest.skip("no madvise here")
    calls: list[tuple[int, int]] = []

    def madvise(address: int, length: int, advice: int) -> int:
        calls.append((address, length))
        return real(address, length, advice)

    monkeypatch.setattr(pages, "_madvise", lambda: madvise)
    granule = shm_module.POPULATE_GRANULE
    capacity = 16 * granule
    fd = os.memfd_create("kvpool-test-arena")
    os.ftruncate(fd, Arena.file_size(capacity))
    mapping = ShmMapping(os.dup(fd), {"socket": "", "capacity": capacity,
                                      "file_size": Arena.file_size(capacity)}, writable=True)
    try:
        assert mapping._populator is not None
        base = mapping._populator._address

        def write(offset: int, nbytes: int) -> bytes:
            payload = os.urandom(nbytes)
            mapping.write(ShmItem(0, offset, nbytes + ENVELOPE_HEADER_SIZE, 0),
                          [memoryview(payload)], chunk_index=0, num_tokens=0,
                          fingerprint=bytes(16))
            end = offset + ENVELOPE_HEADER_SIZE + nbytes
            assert bytes(open_envelope(mapping.view[offset:end])) == payload
            return payload

        write(granule + 4096, granule)  # spans granules 1 and 2
        assert calls == [(base + granule, 2 * granule)]
        write(granule + 4096, granule)  # the same slot again: mapped already
        write(2 * granule, granule - ENVELOPE_HEADER_SIZE)  # inside granule 2
        assert len(calls) == 1
        write(2 * granule, 2 * granule)  # granules 2-4: 4 is new, all three asked for
        assert calls[1:] == [(base + 2 * granule, 3 * granule)]
        last = write(capacity - granule, granule - ENVELOPE_HEADER_SIZE)  # the arena's end
        assert calls[2:] == [(base + capacity - granule, granule)]
        assert len(last) == granule - ENVELOPE_HEADER_SIZE
    finally:
        mapping.close()
        os.close(fd)
