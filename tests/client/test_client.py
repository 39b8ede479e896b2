"""The SDK against a real node process on 127.0.0.1."""

from __future__ import annotations

import asyncio
import inspect
import os
import time

import numpy as np
import pytest

from kvpool.client import (
    AsyncClient,
    BufferTooSmallError,
    CapacityError,
    Client,
    InvalidKeyError,
    KvpoolConnectionError,
    ValueTooLargeError,
)
from kvpool.placement.keys import ChunkHasher, Namespace
from kvpool.protocol.errors import ConfigError
from tests.conftest import NodeProcess, NoLoop, put_corrupt, start_node


def rkey() -> bytes:
    return os.urandom(16)


@pytest.fixture(params=["auto", "tcp"])
def client(node: NodeProcess, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """The sync client as it comes (this node is on the same host: GETs and big puts go
    through shared memory, the rest over its blocking socket), and over TCP only."""
    with Client(node.url, timeout=10, shm=None if request.param == "auto" else False) as c:
        yield c


def test_put_get_roundtrip_sizes(client: Client) -> None:
    for size in (0, 1, 4095, 4096, 300_000, 3 << 20):
        k, v = rkey(), os.urandom(size)
        client.put(k, v)
        got = client.get(k)
        assert got == v and isinstance(got, bytearray)


def test_get_into_caller_buffer(client: Client) -> None:
    k, v = rkey(), os.urandom(1 << 20)
    client.put(k, v)
    buf = np.zeros(2 << 20, dtype=np.uint8)
    assert client.get_into(k, buf) == len(v)
    assert buf[: len(v)].tobytes() == v
    assert client.get_into(rkey(), buf) is None
    with pytest.raises(BufferTooSmallError):
        client.get_into(k, bytearray(100))
    with pytest.raises(ValueError, match="writable"):
        client.get_into(k, bytes(2 << 20))


def test_segmented_values_are_sent_and_received_in_order(client: Client) -> None:
    """A value may be a list of buffers (writev/readv style), on put and on get_into."""
    parts = [os.urandom(n) for n in (1, 70_000, 0, 4096, 12_345)]
    whole = b"".join(parts)
    k = rkey()
    client.put(k, [parts[0], memoryview(parts[1]), bytearray(parts[2]),
                   np.frombuffer(parts[3], dtype=np.uint32).reshape(32, 32), parts[4]])
    assert client.get(k) == whole
    a, b, c = np.zeros((10, 1000), dtype=np.uint8), bytearray(80_000), bytearray(80_000)
    assert client.get_into(k, [a, memoryview(b)[:5], c]) == len(whole)  # c has room to spare
    assert a.tobytes() == whole[:10_000] and bytes(b[:5]) == whole[10_000:10_005]
    assert bytes(c[: len(whole) - 10_005]) == whole[10_005:] and not any(b[5:])
    keys = [rkey(), rkey()]
    client.put_many(keys, [[b"ab", b"cd"], b"efgh"])
    x, y, z = bytearray(1), bytearray(3), bytearray(4)
    assert client.get_many_into(keys, [(x, y), z]) == [4, 4]
    assert bytes(x + y) == b"abcd" and z == b"efgh"
    with pytest.raises(BufferTooSmallError, match="buffer of 3 bytes"):
        client.get_into(keys[0], [bytearray(1), bytearray(2)])
    with pytest.raises(ValueError, match="writable"):
        client.get_into(keys[0], [bytearray(2), b"xx"])


def test_batches(client: Client) -> None:
    keys = [rkey() for _ in range(20)]
    values = [os.urandom(1000 + i) for i in range(20)]
    client.put_many(keys, values, chunk_indexes=list(range(20)))
    missing = rkey()
    assert client.exists_many([*keys, missing]) == [True] * 20 + [False]
    assert client.get_many([keys[3], missing, keys[7]]) == [values[3], None, values[7]]
    bufs = [bytearray(2000) for _ in range(3)]
    assert client.get_many_into([keys[0], missing, keys[19]], bufs) == [1000, None, 1019]
    assert bufs[2][:1019] == values[19]
    assert client.delete_many([keys[0], missing]) == [True, False]
    assert not client.exists(keys[0])


def test_batch_larger_than_max_batch_is_split(client: Client) -> None:
    max_batch = int(client.server_info["max_batch"])
    keys = [rkey() for _ in range(max_batch + 5)]
    client.put_many(keys, [b"v"] * len(keys))
    assert all(client.exists_many(keys))
    assert client.lookup(keys) == len(keys)


def test_lookup_leading_prefix(client: Client) -> None:
    hasher = ChunkHasher(Namespace("test-model", "float16", 2, 1, 8, chunk_tokens=16))
    keys = hasher.keys(list(range(16 * 6)))
    client.put_many(keys[:4], [b"kv"] * 4, chunk_indexes=range(4))  # type: ignore[arg-type]
    assert client.lookup(keys) == 4
    assert client.lookup([k.hex() for k in keys[:3]]) == 3  # hex keys work too
    client.delete(keys[1])
    assert client.lookup(keys) == 1
    assert client.lookup([]) == 0


def test_pin_unpin(client: Client) -> None:
    k = rkey()
    assert not client.pin(k)
    client.put(k, b"x", pin=True)
    assert client.stats()["tiers"]["dram"]["num_pinned"] >= 1
    assert client.unpin(k) and client.pin(k) and client.unpin(k)


def test_ttl(client: Client) -> None:
    k = rkey()
    client.put(k, b"short-lived", ttl=0.3)
    assert client.exists(k)
    deadline = time.monotonic() + 5
    while client.exists(k) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not client.exists(k)
    with pytest.raises(ValueError):
        client.put(k, b"x", ttl=0)


def test_stats(client: Client) -> None:
    before = client.stats()
    k = rkey()
    client.put(k, b"abc")
    client.get(k)
    client.get(rkey())
    after = client.stats()
    assert after["requests"]["put"] == before["requests"]["put"] + 1
    assert after["hits"] == before["hits"] + 1 and after["misses"] == before["misses"] + 1
    assert after["capacity_bytes"] == 64 << 20


def test_client_side_validation(client: Client) -> None:
    with pytest.raises(InvalidKeyError):
        client.get(b"short")
    with pytest.raises(InvalidKeyError):
        client.put("zz" * 16, b"x")
    with pytest.raises(ValueTooLargeError):
        client.put(rkey(), bytes(int(client.server_info["max_value_bytes"])))
    with pytest.raises(ConfigError):
        Client("http://127.0.0.1:1")


def test_capacity_error_when_everything_pinned(small_node: NodeProcess) -> None:
    with Client(small_node.url) as c:
        pinned = [rkey() for _ in range(4)]
        c.put_many(pinned, [os.urandom(200_000)] * 4, pin=True)
        with pytest.raises(CapacityError) as info:
            c.put_many([rkey(), rkey()], [os.urandom(300_000)] * 2)
        assert len(info.value.failed_keys) == 2
        assert all(c.exists_many(pinned))


def test_eviction_keeps_node_within_capacity(small_node: NodeProcess) -> None:
    with Client(small_node.url) as c:
        keys = [rkey() for _ in range(40)]
        for k in keys:
            c.put(k, os.urandom(100_000))
        stats = c.stats()
        assert stats["evictions"] > 0
        assert stats["tiers"]["dram"]["allocated_bytes"] <= stats["capacity_bytes"]
        assert c.exists(keys[-1]) and not c.exists(keys[0])


def test_connection_refused_is_clear() -> None:
    with pytest.raises(KvpoolConnectionError, match="cannot connect"):
        Client("kvpool://127.0.0.1:1", connect_timeout=2).get(rkey())


async def test_async_client_concurrent(node: NodeProcess) -> None:
    async with AsyncClient(node.url, pool_size=3) as c:
        keys = [rkey() for _ in range(50)]
        values = [os.urandom(50_000) for _ in range(50)]
        await asyncio.gather(*(c.put(k, v) for k, v in zip(keys, values, strict=True)))
        got = await asyncio.gather(*(c.get(k) for k in keys))
        assert got == values
        assert await c.lookup(keys) == 50


async def test_node_restart_reconnects() -> None:
    n = start_node("--dram-capacity", "8MiB")
    c = AsyncClient(n.url)
    await c.put(rkey(), b"x")
    n.stop()
    with pytest.raises(KvpoolConnectionError):
        await c.get(rkey())
    await c.close()


async def test_a_standalone_node_is_routed_by_its_one_node_map_and_is_probed_again() -> None:
    """No second mode: the client routes to a standalone node by a map of that node alone
    (epoch 0, at the address it was given); a node that went away raises its own error,
    and the node restarted on its port answers the next call (no back-off wait)."""
    n = start_node("--dram-capacity", "8MiB", "--no-ssd")
    c = AsyncClient(n.url)
    try:
        key = rkey()
        await c.put(key, b"x" * 100)
        cmap = c.map
        assert cmap is not None and cmap.is_standalone and c.epoch == 0
        assert [(node.id, node.data_address) for node in cmap.nodes] == \
            [(c.server_info["node_id"], (n.host, n.port))]
        assert await c.exists_tiers([key, rkey()]) == ["dram", None]
        n.stop()
        with pytest.raises(KvpoolConnectionError, match=f"{n.host}:{n.port}"):
            await c.get(key)
        n = start_node("--dram-capacity", "8MiB", "--no-ssd", "--data-port", str(n.port))
        assert await c.get(key) is None  # a fresh DRAM-only node: a miss, not an error
        await c.put(key, b"y")
        assert await c.get(key) == b"y"
    finally:
        await c.close()
        n.stop()


@pytest.mark.timeout(30)  # a hang fails here, not a clock assert
def test_silent_node_times_out() -> None:
    import socket

    from kvpool.client import KvpoolTimeoutError

    with socket.socket() as listener:  # accepts, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        c = Client(f"kvpool://127.0.0.1:{port}", timeout=0.3)
        with pytest.raises(KvpoolTimeoutError, match=r"no reply within 0\.3s"):
            c.get(rkey())
        c.close()


def test_corrupt_value_is_a_miss_and_is_dropped(node: NodeProcess) -> None:
    """A value whose payload fails its checksum never comes back as a hit."""
    k = rkey()
    put_corrupt(node, k, os.urandom(10_000), flip=5000)
    with Client(node.url) as c:
        assert c.exists(k)
        assert c.get(k) is None
        assert c.num_corrupt == 1
        assert not c.exists(k)  # the client dropped it where it lay
        assert c.get_into(k, bytearray(20_000)) is None
        assert c.get_into(k, [bytearray(5_000), bytearray(5_000)]) is None


def test_seeds_are_taken_in_every_form_cluster_up_and_the_docs_print() -> None:
    from kvpool.client._node import parse_seeds

    want = [("127.0.0.1", 7700), ("127.0.0.1", 7702), ("10.0.0.5", 7704)]
    for form in ("127.0.0.1:7700,127.0.0.1:7702,10.0.0.5:7704",
                 "kvpool://127.0.0.1:7700,127.0.0.1:7702,10.0.0.5:7704",
                 "kvpool://127.0.0.1:7700, kvpool://127.0.0.1:7702 ,10.0.0.5:7704,",
                 ["kvpool://127.0.0.1:7700,127.0.0.1:7702", "10.0.0.5:7704"]):
        assert parse_seeds(form) == want, form
    assert parse_seeds("example.org") == [("example.org", 7700)]
    for bad in ("", " , ", [], "http://a:1,b:2", "a:1,b:port"):
        with pytest.raises(ConfigError):
            parse_seeds(bad)


def test_client_takes_a_seed_string_and_kvpool_url(node: NodeProcess,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with Client(f"kvpool://{node.host}:{node.port},127.0.0.1:1") as c:
        c.put(bytes(16), b"seed string")
    monkeypatch.setenv("KVPOOL_URL", f"127.0.0.1:1,{node.host}:{node.port}")
    with Client() as c:  # the first seed is dead: the next one answers
        assert c.get(bytes(16)) == b"seed string"


#: AsyncClient coroutines with no blocking twin, and why
NO_SYNC_TWIN: dict[str, str] = {}


def test_every_async_coroutine_has_a_sync_twin_with_the_same_signature() -> None:
    """The blocking Client re-declares the async API by hand: nothing else keeps the two
    from drifting apart (a parameter added to one, a default changed in the other)."""
    checked = 0
    for name, fn in inspect.getmembers(AsyncClient, inspect.isfunction):
        coro = inspect.unwrap(fn)  # traced methods are plain functions returning coroutines
        if name.startswith("_") or name in NO_SYNC_TWIN or \
                not inspect.iscoroutinefunction(coro):
            continue
        twin = getattr(Client, name, None)
        assert callable(twin), f"Client has no {name}()"
        assert not inspect.iscoroutinefunction(twin), f"Client.{name} is a coroutine"
        assert inspect.signature(twin) == inspect.signature(coro), name
        checked += 1
    assert checked >= 20
    assert all(hasattr(AsyncClient, name) for name in NO_SYNC_TWIN)  # no stale exemption
    # the constructors too: the sync one takes the async one's arguments, then its own
    sync_init = inspect.signature(Client.__init__).parameters
    async_init = inspect.signature(AsyncClient.__init__).parameters
    assert list(sync_init.values())[: len(async_init)] == list(async_init.values())
    assert list(sync_init)[len(async_init) :] == ["blocking"]


def test_sync_calls_over_tcp_run_no_event_loop(node: NodeProcess) -> None:
    """Once connected, every key op of a sync client of a TCP node runs in the calling
    thread on its blocking socket, with the same results the loop gives."""
    k, v = rkey(), os.urandom(300_000)
    with Client(node.url, shm=False) as c:
        loop = c._free.loop
        c._free.loop = NoLoop(loop)  # type: ignore[assignment]
        try:
            c.put(k, v, pin=True)
            assert c.get(k) == v
            buf = bytearray(len(v))
            assert c.get_into(k, [memoryview(buf)[:1000], memoryview(buf)[1000:]]) == len(v)
            assert buf == v
            assert c.exists_many([k, rkey()]) == [True, False]
            assert c.exists_tiers([k]) == ["dram"]
            assert c.lookup_tiers([k, rkey(), k]) == ["dram"]
            assert c.unpin(k) and c.pin(k) and c.unpin(k)
            assert c.delete_many([k, rkey()]) == [True, False]
            assert c.get(k) is None
            with pytest.raises(BufferTooSmallError):
                c.put(k, v)
                c.get_into(k, bytearray(10))
        finally:
            c._free.loop = loop
        assert c.bytes_by_path == {"shm": 0, "tcp": 2 * len(v)}


def test_sync_client_reopens_a_socket_the_node_closed() -> None:
    """The node closes idle connections (and restarts): the next call notices before it
    sends, and opens a new socket instead of failing."""
    n = start_node("--dram-capacity", "8MiB", "--no-ssd", "--idle-timeout", "0.5")
    try:
        with Client(n.url, shm=False) as c:
            k = rkey()
            c.put(k, b"idle")
            time.sleep(1.2)  # the node has closed both of this client's connections
            assert c.get(k) == b"idle"
            assert c.exists(k)
    finally:
        n.stop()


@pytest.mark.timeout(60)  # a hang fails here, not a clock assert
def test_a_stopped_node_times_out_the_blocking_path_and_the_next_call_recovers(
        node: NodeProcess) -> None:
    import signal

    from kvpool.client import KvpoolTimeoutError

    k = rkey()
    with Client(node.url, shm=False, timeout=0.5) as c:
        c.put(k, b"before the stop")
        node.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(KvpoolTimeoutError, match=r"GET to .* no reply within 0\.5s"):
                c.get(k)
        finally:
            node.proc.send_signal(signal.SIGCONT)
        assert c.get(k) == b"before the stop"  # on a new socket: the old one's state is unknown


def test_an_interrupted_blocking_call_leaves_no_reply_for_the_next(node: NodeProcess) -> None:
    """Ctrl-C (any exception) while the blocking socket waits for a reply: that reply
    must not be taken for the next call's. The socket is dropped and the next call opens
    another."""
    import signal

    class Interrupted(BaseException):
        pass

    def interrupt(_signum: int, _frame: object) -> None:
        raise Interrupted

    k = rkey()
    with Client(node.url, shm=False) as c:
        c.put(k, b"the value")
        previous = signal.signal(signal.SIGALRM, interrupt)
        node.proc.send_signal(signal.SIGSTOP)  # the GET waits: its reply comes later
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            with pytest.raises(Interrupted):
                c.get(k)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            node.proc.send_signal(signal.SIGCONT)
        assert c.exists_many([rkey(), k]) == [False, True]
        assert c.get(k) == b"the value"
