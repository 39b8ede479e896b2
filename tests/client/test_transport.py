"""The SDK's routing logic on a MockTransport: no node process, no socket.

Nodes are :class:`~tests.mock_nodes.MockNode` objects answering parsed frames; the
client under test is the real one (connections, plans, checksums, router). What the
real node does is every other test's subject.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable

import pytest

from kvpool.client import AsyncClient, Client, KvpoolConnectionError, KvpoolTimeoutError
from kvpool.client import _socket as socket_module
from kvpool.client._connection import Buffer
from kvpool.client._node import NodeClient
from kvpool.client._options import ClientOptions
from kvpool.client._socket import BlockingConnection
from kvpool.placement.cluster_map import ClusterMap, NodeInfo, NodeState
from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE
from kvpool.protocol.errors import ConfigError, Status
from kvpool.protocol.frames import FRAME_HEADER_SIZE, FrameHeader, Op, encode_frame
from kvpool.protocol.parsers import Request
from tests.conftest import NoLoop, no_loop
from tests.mock_nodes import MockNode, MockNodes


def rkey() -> bytes:
    return os.urandom(16)


def standalone(max_batch: int = 4096) -> MockNodes:
    return MockNodes({"127.0.0.1:7700": MockNode("solo", max_batch=max_batch)})


def cluster(epoch: int = 1, ids: tuple[str, ...] = ("a", "b", "c"), *,
            replication: int = 2, fallbacks: int = 1) -> MockNodes:
    infos = tuple(NodeInfo(id=i, data=f"10.0.0.{n}:7700") for n, i in enumerate(ids, 1))
    cmap = ClusterMap(epoch=epoch, nodes=infos, replication=replication, fallbacks=fallbacks)
    return MockNodes({info.data: MockNode(info.id) for info in infos}, cmap)


@pytest.mark.parametrize("blocking", [True, False])
def test_the_sync_client_runs_on_a_mock_transport_with_no_node(blocking: bool) -> None:
    """Every op of a standalone node, split by the node's max_batch, with no socket: on
    the transport's blocking link in the calling thread (no event loop run once
    connected), or on the loop with ``blocking=False``. The same-host fast path is off
    on a mock transport."""
    mock = standalone(max_batch=4)
    node = mock.nodes["127.0.0.1:7700"]
    keys = [rkey() for _ in range(10)]
    values = [os.urandom(100 + i) for i in range(10)]
    with Client("127.0.0.1:7700", transport=mock.transport, blocking=blocking) as c:
        assert c._free.direct_node is not None
        loop = c._free.loop
        if blocking:
            c._free.loop = NoLoop(loop)  # type: ignore[assignment]
        c.put_many(keys, values)
        assert [n for op, n in node.seen if op == Op.PUT] == [4, 4, 2]
        assert set(node.store) == set(keys)
        assert c.get_many(keys) == values
        buffer = bytearray(200)
        assert c.get_into(keys[3], buffer) == len(values[3])
        assert bytes(buffer[: len(values[3])]) == values[3]
        assert c.exists_tiers([keys[0], rkey()]) == ["dram", None]
        assert c.lookup([*keys[:5], rkey(), keys[6]]) == 5
        assert c.delete_many([keys[0], rkey()]) == [True, False]
        assert c.get(keys[0]) is None
        c._free.loop = loop
        assert c.map is not None and c.map.is_standalone and c.epoch == 0
    assert c.bytes_by_path["shm"] == 0


def test_the_sync_clients_blocking_link_fails_and_recovers_as_a_socket_would() -> None:
    """On the mock transport's blocking link: a node that never answers is a timeout (at
    once: the mock has no clock), a connection that breaks is a connection error, and
    the next call opens a new link; a node that is down refuses it."""
    mock = standalone()
    node = mock.nodes["127.0.0.1:7700"]
    key = rkey()
    with Client("127.0.0.1:7700", transport=mock.transport, timeout=0.2) as c:
        loop = c._free.loop
        c._free.loop = NoLoop(loop)  # type: ignore[assignment]
        c.put(key, b"v")
        node.silent.add(Op.GET)
        with pytest.raises(KvpoolTimeoutError, match=r"GET to 127\.0\.0\.1:7700 got no reply"):
            c.get(key)
        node.silent.clear()
        assert c.get(key) == b"v"  # a new link
        mock.transport.drop("127.0.0.1:7700")
        assert c.exists(key)  # the dropped link was seen stale: a new one
        mock.transport.down.add("127.0.0.1:7700")
        mock.transport.drop("127.0.0.1:7700")
        with pytest.raises(KvpoolConnectionError, match="connection refused"):
            c.get(key)
        c._free.loop = loop


async def test_a_corrupt_value_is_a_miss_and_is_deleted_where_it_lay() -> None:
    mock = standalone()
    node = mock.nodes["127.0.0.1:7700"]
    key = rkey()
    async with AsyncClient("127.0.0.1:7700", transport=mock.transport) as c:
        await c.put(key, b"v" * 1000)
        stored = bytearray(node.store[key])
        stored[ENVELOPE_HEADER_SIZE + 500] ^= 0xFF
        node.store[key] = bytes(stored)
        assert await c.get(key) is None
        assert c.num_corrupt == 1
        assert key not in node.store  # the client sent the DELETE
        assert (Op.DELETE, 1) in node.seen


async def test_a_cluster_stores_on_the_owners_and_reads_past_a_dead_one() -> None:
    mock = cluster()
    assert mock.map is not None
    keys = [rkey() for _ in range(60)]
    values = [os.urandom(64) for _ in keys]
    async with AsyncClient("10.0.0.1:7700", transport=mock.transport) as c:
        await c.put_many(keys, values)
        owners = [set(p[:2]) for p in mock.map.preference(keys)]
        assert [mock.holders(k) for k in keys] == owners
        assert await c.get_many(keys) == values
        # one GET frame a node: the batch split by owner, not a request per key
        assert sum(1 for n in mock.nodes.values() for op, _ in n.seen if op == Op.GET) <= 3

        dead = "10.0.0.2:7700"  # node b
        mock.transport.down.add(dead)
        mock.transport.drop(dead)
        assert await c.get_many(keys) == values  # from each key's other owner
        assert not c._router.nodes["b"].live
        fresh = [rkey() for _ in range(30)]
        await c.put_many(fresh, [b"x"] * 30)  # b's share goes to the fallback
        for key, pref in zip(fresh, mock.map.preference(fresh), strict=True):
            expect = {n for n in pref if n != "b"}
            assert mock.holders(key) == expect
        assert await c.exists_many(fresh) == [True] * 30


async def test_wrong_owner_refreshes_the_map_and_the_call_goes_to_the_new_owners() -> None:
    """The client routes by epoch 1 (a, b); the nodes have moved to epoch 2 (c joined) and
    refuse keys they no longer own (no fallbacks: a node accepts only what it owns). One
    call: a refresh, then the new owners."""
    mock = cluster(epoch=1, ids=("a", "b"), replication=1, fallbacks=0)
    async with AsyncClient("10.0.0.1:7700", transport=mock.transport) as c:
        await c.connect()
        assert c.epoch == 1
        assert mock.map is not None
        infos = (*mock.map.nodes, NodeInfo(id="c", data="10.0.0.3:7700"))
        mock.nodes["10.0.0.3:7700"] = MockNode("c")
        mock.map = ClusterMap(epoch=2, nodes=infos, replication=1, fallbacks=0)
        keys = [rkey() for _ in range(40)]
        await c.put_many(keys, [b"y"] * 40)
        assert c.epoch == 2
        owners = [p[0] for p in mock.map.preference(keys)]
        assert "c" in owners
        assert [mock.holders(k) for k in keys] == [{o} for o in owners]
        assert await c.get_many(keys) == [b"y"] * 40
        refused = sum(1 for n in mock.nodes.values() for op, _ in n.seen if op == Op.PUT)
        assert refused > 3  # a PUT a node under epoch 1, then under epoch 2


async def test_a_draining_node_is_read_after_the_owners() -> None:
    mock = cluster(ids=("a", "b"), replication=1)
    assert mock.map is not None
    key = rkey()
    async with AsyncClient("10.0.0.1:7700", transport=mock.transport) as c:
        await c.connect()
        await c.put(key, b"z")
        # the node that holds it drains: it owns nothing under epoch 2
        (holder,) = mock.holders(key)
        infos = tuple(NodeInfo(id=n.id, data=n.data, state=NodeState.DRAINING
                               if n.id == holder else NodeState.UP) for n in mock.map.nodes)
        mock.map = ClusterMap(epoch=2, nodes=infos, replication=1, fallbacks=1)
        await c._router.refresh(min_epoch=2)
        assert c.epoch == 2
        assert await c.get(key) == b"z"


@pytest.mark.timeout(30)  # a hang fails here, not a clock assert
async def test_a_node_that_never_answers_times_out_within_the_deadline() -> None:
    mock = standalone()
    mock.nodes["127.0.0.1:7700"].silent.add(Op.GET)
    async with AsyncClient("127.0.0.1:7700", transport=mock.transport, timeout=0.2) as c:
        await c.put(rkey(), b"x")
        with pytest.raises(KvpoolTimeoutError, match=r"no reply within 0\.2s"):
            await c.get(rkey())
        assert await c.exists(rkey()) is False  # a fresh connection serves the next call


async def test_a_standalone_node_that_refuses_connections_raises_its_own_error() -> None:
    mock = standalone()
    async with AsyncClient("127.0.0.1:7700", transport=mock.transport) as c:
        await c.put(rkey(), b"x")
        mock.transport.down.add("127.0.0.1:7700")
        mock.transport.drop("127.0.0.1:7700")
        with pytest.raises(KvpoolConnectionError,
                           match=re.escape("cannot connect to kvpool node 127.0.0.1:7700")):
            await c.get(rkey())
        mock.transport.down.clear()  # back: the next call reaches it, no back-off wait
        assert await asyncio.wait_for(c.exists(rkey()), 2) is False


def test_the_sync_clients_blocking_link_refuses_a_reply_to_another_request() -> None:
    """A reply under another request id ends the link with a connection error, as a
    socket's link does (the stream cannot be trusted after it)."""
    mock = standalone()
    answer = mock.transport.handler

    def misnumbered(address: str, request: Request) -> Iterable[Buffer] | None:
        reply = answer(address, request)
        if request.header.op != Op.EXISTS or reply is None:
            return reply
        frame = bytearray(b"".join(reply))
        frame[4:8] = (request.header.request_id + 1).to_bytes(4, "little")  # the id field
        return [bytes(frame)]

    mock.transport.handler = misnumbered
    with Client("127.0.0.1:7700", transport=mock.transport) as c:
        loop = c._free.loop
        c._free.loop = NoLoop(loop)  # type: ignore[assignment]
        try:
            with pytest.raises(KvpoolConnectionError, match="answered request"):
                c.exists(rkey())
        finally:
            c._free.loop = loop


def one_request(listener: socket.socket) -> tuple[socket.socket, FrameHeader]:
    """A peer's half: accept one connection on ``listener`` and read its first request
    frame; the connection and that frame's header (its body read and dropped)."""
    conn, _ = listener.accept()
    header = FrameHeader.unpack(conn.recv(FRAME_HEADER_SIZE, socket.MSG_WAITALL))
    conn.recv(header.body_len, socket.MSG_WAITALL)
    return conn, header


@pytest.mark.parametrize("status", [Status.OK, Status.BAD_FRAME])
def test_the_socket_link_ends_on_a_reply_to_another_request(status: Status) -> None:
    """The same over a real socket: a peer on 127.0.0.1 answers one EXISTS under the next
    request id. An OK reply is a connection error; an error frame (the node refused the
    frame itself) is handed back. Either way the link is closed."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def peer() -> None:
        conn, header = one_request(listener)
        with conn:
            body = b"\x00" * header.count if status == Status.OK else b"refused"
            conn.sendall(b"".join(encode_frame(header.op, header.request_id + 1, [body],
                                               count=header.count, status=status)))
            conn.recv(1)  # until the client closes

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    link = BlockingConnection("127.0.0.1", port, timeout=5, connect_timeout=5)
    try:
        if status == Status.OK:
            with pytest.raises(KvpoolConnectionError, match="answered request 2, not 1"):
                link.call(Op.EXISTS, 1, [os.urandom(16)])
        else:
            reply = link.call(Op.EXISTS, 1, [os.urandom(16)])
            assert reply.header.status == status and bytes(reply.body) == b"refused"
        assert not link.is_open
    finally:
        link.close()
        thread.join(5)
        listener.close()


class KernelTimeouts:
    """The socket timeouts a link asks the kernel for (``_timeval``'s arguments, in
    seconds, in order): what a call may wait, read without a clock."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.asked: list[float] = []
        original = socket_module._timeval

        def record(seconds: float) -> bytes:
            self.asked.append(seconds)
            return original(seconds)

        monkeypatch.setattr(socket_module, "_timeval", record)


def stalled_midway(monkeypatch: pytest.MonkeyPatch, body: int, pause: float, until: int
                   ) -> list[float]:
    """A STATS call (timeout 0.6 s) whose reply frame of a ``body``-byte body comes: its
    first 1,000 bytes, a ``pause``, bytes up to ``until``, then nothing. Checks that the
    call fails with a timeout and closes the link; the kernel timeouts it asked for."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    done = threading.Event()

    def peer() -> None:
        conn, header = one_request(listener)
        with conn:
            frame = b"".join(encode_frame(header.op, header.request_id, [b" " * body]))
            conn.sendall(frame[:1000])
            time.sleep(pause)
            conn.sendall(frame[1000:until])
            done.wait(5)

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    link = BlockingConnection("127.0.0.1", port, timeout=0.6, connect_timeout=5)
    timeouts = KernelTimeouts(monkeypatch)
    try:
        with pytest.raises(KvpoolTimeoutError, match=r"no reply within 0\.6s"):
            link.call(Op.STATS, 0, [])
        assert not link.is_open
        return timeouts.asked
    finally:
        done.set()
        link.close()
        thread.join(5)
        listener.close()


@pytest.mark.timeout(20)
def test_the_socket_link_keeps_its_deadline_when_a_reply_stalls_midway(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A long reply whose first bytes come at once and the rest never: the call fails with
    a timeout at its deadline (0.6 s), not a whole timeout after the last bytes came.
    The link waits in blocking receives with the kernel's timeout, cut to what is left of
    the call once a 16th of it has passed: after the peer's 0.35 s pause the kernel is
    asked to wait at most what is left (< 0.3 s), never a whole 0.6 s again. (A body
    under _WAIT_MIN: received as it comes, a receive per piece.)"""
    asked = stalled_midway(monkeypatch, 60_000, 0.35, 2000)
    assert asked, "the link never cut the kernel's timeout"
    # without the cut the last receive would wait a whole 0.6 s from 0.35 s
    assert max(asked) < 0.3, asked


@pytest.mark.timeout(20)
def test_a_long_body_waited_for_whole_still_ends_at_the_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A body of 1 MiB is received with MSG_WAITALL (256 KiB a receive): when it stalls
    midway (less than one waited-for receive came), the receive returns what came at the
    kernel's timeout, set to at most the call's, and the call fails with a timeout: it
    neither waits for bytes that never come nor takes the partial receive for the whole."""
    asked = stalled_midway(monkeypatch, 1 << 20, 0.2, 100_000)
    assert all(t <= 0.6 for t in asked), asked


@pytest.mark.timeout(20)
def test_the_socket_link_times_out_a_request_the_peer_does_not_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that accepts and never reads: a 32 MiB request fills the socket buffers and
    the send waits; the call fails with a timeout at its deadline (0.5 s), not a
    connection error."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    link = BlockingConnection("127.0.0.1", port, timeout=0.5, connect_timeout=5)
    peer, _ = listener.accept()
    timeouts = KernelTimeouts(monkeypatch)
    try:
        with pytest.raises(KvpoolTimeoutError, match=r"no reply within 0\.5s"):
            link.call(Op.PUT, 1, [bytes(32 << 20)])
        # no send waits past the call's deadline: any cut asks for what is left of 0.5 s
        assert all(t <= 0.5 for t in timeouts.asked), timeouts.asked
        assert not link.is_open
    finally:
        link.close()
        peer.close()
        listener.close()


class CountingPoll:
    """A link's ``select.poll`` that counts its non-blocking polls (a busy poll's steps)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.spins = 0

    def poll(self, timeout: float | None = None) -> list[tuple[int, int]]:
        if timeout == 0:
            self.spins += 1
        return self.inner.poll(timeout)  # type: ignore[attr-defined,no-any-return]


def test_the_socket_link_polls_for_a_small_calls_reply_then_sleeps() -> None:
    """``busy_poll_us``: a small call polls its socket for the reply before the thread
    sleeps, and still gets a reply that comes later; a call whose reply may fill
    megabytes sleeps at once. The peer answers each request 30 ms late; the polls are
    counted (a poll that ran at all is a step or more, however busy the machine)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def peer() -> None:
        conn, _ = listener.accept()
        with conn:
            while True:
                head = conn.recv(FRAME_HEADER_SIZE, socket.MSG_WAITALL)
                if len(head) < FRAME_HEADER_SIZE:
                    return
                header = FrameHeader.unpack(head)
                conn.recv(header.body_len, socket.MSG_WAITALL)
                time.sleep(0.03)
                conn.sendall(b"".join(encode_frame(header.op, header.request_id, [b"{}"])))

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    link = BlockingConnection("127.0.0.1", port, timeout=5, connect_timeout=5,
                              busy_poll_us=10_000)
    counter = CountingPoll(link._poll)
    link._poll = counter  # type: ignore[assignment]
    try:
        def spins_of(sinks: list[memoryview] | None) -> int:
            before = counter.spins
            assert bytes(link.call(Op.STATS, 0, [], sinks).body) == b"{}"
            return counter.spins - before

        assert spins_of(None) > 0  # polled, then slept until the reply came
        assert spins_of([memoryview(bytearray(4096))]) > 0  # small buffers: polled too
        assert spins_of([memoryview(bytearray(1 << 20))]) == 0  # asleep at once
    finally:
        link.close()
        listener.close()
        thread.join(5)
    for bad in (-1.0, float("nan"), 20_000.0):
        with pytest.raises(ConfigError, match="busy_poll_us"):
            Client("127.0.0.1:1", busy_poll_us=bad)


def held_20_of_50(c: Client, mock: MockNodes) -> list[bytes]:
    """50 keys, the first 20 put through ``c``; the nodes' request logs cleared."""
    keys = [rkey() for _ in range(50)]
    c.put_many(keys[:20], [b"v"] * 20)
    for node in mock.nodes.values():
        node.seen.clear()
    return keys


def test_the_sync_client_asks_a_small_cluster_on_blocking_links_in_parallel() -> None:
    """Every key's list is every node (3 nodes, replication 2 + 1 fallback): the sync
    client's key ops send one EXISTS frame to each node and read the replies with no
    event loop. A node that fails is marked down and the others' answers are the answer,
    as on the loop; while it is down, the others are asked, with no loop either, and
    once its back-off ends it is asked again."""
    mock = cluster()
    with Client("10.0.0.1:7700", transport=mock.transport) as c:
        keys = held_20_of_50(c, mock)
        with no_loop(c):
            assert c.exists_many(keys) == [True] * 20 + [False] * 30
            assert c.lookup(keys) == 20
            assert c.lookup_tiers(keys[:3]) == ["dram"] * 3
        assert all([seen for seen in node.seen if seen[0] != Op.HELLO]
                   == [(Op.EXISTS, 50)] * 2 + [(Op.EXISTS, 3)] for node in mock.nodes.values())
        mock.transport.down.add("10.0.0.1:7700")
        mock.transport.drop("10.0.0.1:7700")
        with no_loop(c):  # b and c answer; a, refused, is marked down
            assert c.exists_many(keys) == [True] * 20 + [False] * 30
        a = c.async_client._router.nodes["a"]
        assert not a.live and a.failures == 1
        with no_loop(c):  # b and c, and no attempt at a while it is down
            assert c.lookup(keys) == 20
        assert a.failures == 1
        a.down_until = 0.0  # its back-off over: asked again (refused again), on the loop:
        assert c.lookup(keys) == 20  # the client has no connection to it any more
        assert a.failures == 2
        with no_loop(c):  # down again: b and c, loop-free
            assert c.lookup(keys) == 20


def test_the_sync_clients_cluster_puts_and_deletes_run_their_rounds_on_blocking_links(
        ) -> None:
    """3 nodes, replication 2: once the client has met every node, a small put and a
    delete run their round plans (the loop's own) on the blocking links, with no event
    loop: each key lands on the first two nodes of its list, as the loop puts it, and a
    delete reaches every node of the list. A put of ``shm_put_min_bytes`` or more runs on
    the loop (a blocking round would send to one node after another)."""
    mock = cluster()
    assert mock.map is not None
    with Client("10.0.0.1:7700", transport=mock.transport) as c:
        held_20_of_50(c, mock)  # (every node met)
        keys = [rkey() for _ in range(12)]
        with no_loop(c):
            c.put_many(keys, [b"w" * 100] * 12)
            assert c.delete_many([keys[0], rkey()]) == [True, False]
        lists = mock.map.preference(keys)
        assert all(mock.holders(k) == set(pref[:2])
                   for k, pref in zip(keys[1:], lists[1:], strict=True))
        assert mock.holders(keys[0]) == set()
        assert all([n for op, n in node.seen if op == Op.PUT]
                   == [sum(node.node_id in pref[:2] for pref in lists)]
                   for node in mock.nodes.values())
        with pytest.raises(AssertionError, match="event loop ran"), no_loop(c):
            c.put(rkey(), bytes(1 << 20))


def test_the_sync_clients_blocking_fan_out_on_a_larger_map_asks_each_node_for_its_keys(
        ) -> None:
    """4 nodes, lists of 3: the sync client's EXISTS round, with no event loop, sends each
    node only the keys whose list holds it, one frame a node, as the loop's fan-out
    does (the async twin below)."""
    mock = cluster(ids=("a", "b", "c", "d"))
    assert mock.map is not None
    with Client("10.0.0.1:7700", transport=mock.transport) as c:
        keys = held_20_of_50(c, mock)
        with no_loop(c):
            assert c.exists_many(keys) == [True] * 20 + [False] * 30
            assert c.lookup(keys) == 20
        lists = mock.map.preference(keys)
        for node in mock.nodes.values():
            asked = [n for op, n in node.seen if op == Op.EXISTS]
            assert asked == [sum(node.node_id in pref for pref in lists)] * 2


def test_the_sync_clients_blocking_fan_out_splits_a_batch_past_max_batch() -> None:
    """Nodes that take 16 keys a frame: each node's 50 keys go as 4 frames, one after
    another on its blocking socket (after the other nodes' first frames), no loop run."""
    mock = cluster()
    for node in mock.nodes.values():
        node.max_batch = 16
    with Client("10.0.0.1:7700", transport=mock.transport) as c:
        keys = held_20_of_50(c, mock)
        with no_loop(c):
            assert c.exists_many(keys) == [True] * 20 + [False] * 30
        assert all([n for op, n in node.seen if op == Op.EXISTS] == [16, 16, 16, 2]
                   for node in mock.nodes.values())


def test_the_sync_clients_blocking_fan_out_refreshes_the_map_a_reply_names() -> None:
    """A node answers under a newer map epoch while no loop runs (the blocking fan-out):
    the client fetches that map after the call, and calls go by it."""
    mock = cluster(epoch=1)
    keys = [rkey() for _ in range(30)]
    with Client("10.0.0.1:7700", transport=mock.transport) as c:
        c.put_many(keys, [b"v"] * 30)
        assert c.epoch == 1
        infos = tuple(NodeInfo(id=i, data=f"10.0.0.{n}:7700")
                      for n, i in enumerate(("a", "b", "c"), 1))
        mock.map = ClusterMap(epoch=2, nodes=infos, replication=2, fallbacks=1)
        assert c.exists_many(keys) == [True] * 30
        assert c.epoch == 2
        assert c.lookup(keys) == 30


def backs_off(node: NodeClient, mark: Callable[[], object], seconds: float) -> bool:
    """Whether ``mark()`` put ``node`` down for ``seconds``: its ``down_until`` lies that
    far from the clock read before the call and the one after (bounds, not a clock
    assert: a slow machine only widens them)."""
    before = time.monotonic()
    mark()
    after = time.monotonic()
    return before + seconds <= node.down_until <= after + seconds


def test_a_node_that_timed_out_is_left_alone_for_ten_timeouts() -> None:
    """A refused or broken node is down for 0.25 s, doubling up to 5 s; one that let a
    deadline pass for ten of the longer of its timeouts, up to a minute (each probe of a
    hung node costs a caller a whole timeout)."""
    node = NodeClient("10.0.0.9", 7700, ClientOptions(timeout=2.0, connect_timeout=1.0))
    assert backs_off(node, lambda: node.mark_down(KvpoolConnectionError("refused")), 0.25)
    assert backs_off(node, lambda: node.mark_down(KvpoolTimeoutError("no reply")), 20.0)
    slow = NodeClient("10.0.0.9", 7700, ClientOptions(timeout=30.0))
    assert backs_off(slow, lambda: slow.mark_down(KvpoolTimeoutError("no reply")), 60.0)


def test_a_node_that_fell_silent_is_suspect_until_it_answers() -> None:
    """Left behind by a fan-out (``mark_slow``): down for a second at least, its
    connections kept; a timeout: down for ten timeouts. Either way *suspect*: reads keep
    away from it after its back-off, until it answers. A lesser failure meanwhile (the
    close of a timed-out node's connections fails its other requests) does not cut a
    longer back-off short; an answer ends it and starts the back-offs over."""
    from kvpool.protocol.frames import FrameHeader, Op
    from kvpool.protocol.parsers import Reply

    node = NodeClient("10.0.0.9", 7700, ClientOptions(timeout=2.0, connect_timeout=1.0))
    assert backs_off(node, node.mark_slow, 1.0)
    assert node.suspect and not node.live and not node.trusted
    node.down_until = time.monotonic()  # its back-off is over
    assert node.live and not node.trusted  # EXISTS probes it, reads keep away
    assert backs_off(node, lambda: node.mark_down(KvpoolTimeoutError("no reply")), 20.0)
    down_until = node.down_until
    node.mark_down(KvpoolConnectionError("connection closed by the client"))
    assert node.down_until == down_until  # the lesser failure left the long back-off
    node.check(Reply(FrameHeader(Op.EXISTS, 1, 0, 0)))  # an answer, any
    assert (node.failures, node.suspect, node.trusted) == (0, False, True)
    # a new failure: back to 0.25 s
    assert backs_off(node, lambda: node.mark_down(KvpoolConnectionError("refused")), 0.25)


@pytest.mark.parametrize("ids", [("a", "b", "c"), ("a", "b", "c", "d")])
async def test_exists_skips_a_node_marked_down_until_its_back_off_ends(
        ids: tuple[str, ...]) -> None:
    """A node that failed is not asked by EXISTS again while it is marked down: the live
    nodes of each key's list answer (a hung node would cost every call a timeout, and a
    scheduler asks for every request). Once its back-off ends it is asked again; keys
    none of whose nodes is live are asked of them anyway (probes)."""
    mock = cluster(ids=ids)
    keys = [rkey() for _ in range(50)]
    async with AsyncClient("10.0.0.1:7700", transport=mock.transport) as c:
        await c.put_many(keys[:20], [b"v"] * 20)
        mock.transport.down.add("10.0.0.2:7700")  # b refuses from now on
        mock.transport.drop("10.0.0.2:7700")
        b = c._router.nodes["b"]
        for _ in range(2):  # b fails once, then is left alone
            assert await c.exists_many(keys) == [True] * 20 + [False] * 30
            assert not b.live and b.failures == 1
        b.down_until = 0.0
        assert await c.exists_many(keys) == [True] * 20 + [False] * 30
        assert b.failures == 2  # asked again once its back-off ended
        for node in c._router.nodes.values():  # every node marked down: each key's
            node.failures, node.down_until = 1, time.monotonic() + 60  # list is probed
        assert await c.exists_many(keys) == [True] * 20 + [False] * 30


@pytest.mark.parametrize("ids", [("a", "b", "c"), ("a", "b", "c", "d")])
async def test_exists_asks_each_node_once_for_the_keys_whose_list_holds_it(
        ids: tuple[str, ...]) -> None:
    """EXISTS asks every node of each key's list at once, one frame a node. When the list
    is every node (3 nodes, replication 2 + 1 fallback) that is the whole batch to each
    node; with a 4th node, each node gets only the keys whose list holds it."""
    mock = cluster(ids=ids)
    assert mock.map is not None
    keys = [rkey() for _ in range(50)]
    async with AsyncClient("10.0.0.1:7700", transport=mock.transport) as c:
        await c.put_many(keys[:20], [b"v"] * 20)
        for node in mock.nodes.values():
            node.seen.clear()
        assert await c.exists_many(keys) == [True] * 20 + [False] * 30
        lists = mock.map.preference(keys)
        for node in mock.nodes.values():
            asked = [n for op, n in node.seen if op == Op.EXISTS]
            assert asked == [sum(node.node_id in pref for pref in lists)]
        if len(ids) == 3:
            assert all(n == 50 for node in mock.nodes.values()
                       for op, n in node.seen if op == Op.EXISTS)
