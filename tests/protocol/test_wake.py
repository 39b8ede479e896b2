"""The node's receive low-water mark while a PUT value comes (protocol/wake.py): the
kernel holds the wake-up until the value's bytes are in, and no mark stalls a node fed a
value in pieces, with frames behind it."""

from __future__ import annotations

import asyncio
import os
import select
import socket
import sys
import time
from collections.abc import Iterator

import pytest

from kvpool.client import AsyncClient, Client
from kvpool.protocol.envelope import seal
from kvpool.protocol.errors import Status
from kvpool.protocol.frames import FrameHeader, Op, PutItemHeader, encode_frame, encode_json
from kvpool.protocol.reader import Exact, Plan, Skip, StreamReader
from kvpool.protocol.wake import WAKE_MAX, WAKE_MIN, WakeMark
from tests.conftest import NodeProcess
from tests.hostile_node import LyingNode

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="SO_RCVLOWAT marks: Linux")


@pytest.fixture
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()
    with sender, receiver:
        yield sender, receiver


def readable(sock: socket.socket, within: float) -> bool:
    return bool(select.select([sock], [], [], within)[0])


def lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


@linux_only
def test_a_mark_holds_the_wakeup_until_the_value_is_in(
        tcp_pair: tuple[socket.socket, socket.socket]) -> None:
    sender, receiver = tcp_pair
    mark = WakeMark(receiver)
    left = 300_000
    mark.expect(left)
    assert mark.mark == lowat(receiver) == left
    sender.sendall(bytes(16 << 10))
    assert not readable(receiver, 0.3)  # without the mark, 16 KiB would wake it
    sender.sendall(bytes(left - (16 << 10)))
    assert readable(receiver, 5.0)
    got = 0
    while got < left:
        got += len(receiver.recv(1 << 20))
    mark.expect(0)  # between values: the next byte wakes it
    assert mark.mark == lowat(receiver) == 1
    sender.sendall(b"x")
    assert readable(receiver, 5.0)


@linux_only
def test_the_mark_stays_within_its_bounds_and_stops_once_closed(
        tcp_pair: tuple[socket.socket, socket.socket]) -> None:
    _, receiver = tcp_pair
    mark = WakeMark(receiver)
    mark.expect(WAKE_MIN - 1)  # a small rest: one segment brings it anyway
    assert mark.mark == lowat(receiver) == 1
    mark.expect(64 << 20)
    assert mark.mark == lowat(receiver) == WAKE_MAX
    mark.expect(0)
    mark.close()
    mark.expect(WAKE_MAX)  # the descriptor may be another connection's now
    assert mark.mark == lowat(receiver) == 1


def test_no_socket_no_mark() -> None:
    mark = WakeMark(None)
    mark.expect(WAKE_MAX)
    assert mark.mark == 1


def hello_and_two_puts(big_key: bytes, big: bytes, small_key: bytes, small: bytes) -> bytes:
    """A HELLO, then a PUT of ``big``, then one of ``small`` (request ids 1, 2, 3)."""
    big_value, small_value = seal(big) + big, seal(small) + small
    return b"".join([
        *encode_frame(Op.HELLO, 1, [encode_json({"protocol": 1})]),
        *encode_frame(Op.PUT, 2, [PutItemHeader(big_key, len(big_value)).pack(), big_value],
                      count=1),
        *encode_frame(Op.PUT, 3, [PutItemHeader(small_key, len(small_value)).pack(),
                                  small_value], count=1)])


def dribble(node: NodeProcess, stream: bytes, cuts: list[int]
            ) -> list[tuple[FrameHeader, bytes]]:
    """``stream`` sent to ``node`` in pieces cut at ``cuts``, 50 ms apart; its 3 replies."""
    with socket.create_connection((node.host, node.port), timeout=10) as s:
        start = 0
        for cut in [*cuts, len(stream)]:
            s.sendall(stream[start:cut])
            start = cut
            time.sleep(0.05)
        return read_reply_frames(s, 3)


def read_reply_frames(sock: socket.socket, n: int) -> list[tuple[FrameHeader, bytes]]:
    data, frames = b"", []
    while len(frames) < n:
        chunk = sock.recv(65536)
        assert chunk, "the node closed the connection"
        data += chunk
        while len(data) >= 24:
            header = FrameHeader.unpack(data[:24])
            if len(data) < 24 + header.body_len:
                break
            frames.append((header, data[24 : 24 + header.body_len]))
            data = data[24 + header.body_len:]
    return frames


@pytest.mark.parametrize("size", [300_000, 3 << 20])
def test_a_value_sent_in_pieces_is_stored_whole_with_a_frame_behind_it(
        node: NodeProcess, size: int) -> None:
    """A value under and over WAKE_MAX, dribbled in with pauses between pieces smaller
    and larger than the mark, then a small PUT right behind it: both stored, in order."""
    big_key, small_key = os.urandom(16), os.urandom(16)
    big, small = os.urandom(size), os.urandom(4096)
    stream = hello_and_two_puts(big_key, big, small_key, small)
    cuts = sorted({100, 20_000, 90_000, size // 3, size // 2, len(stream) - 5000,
                   len(stream) - 10})
    frames = dribble(node, stream, cuts)
    assert [(h.request_id, h.status) for h, _ in frames] == [(1, 0), (2, 0), (3, 0)]
    with Client(node.url, shm=False) as client:
        assert client.get(big_key) == big
        assert client.get(small_key) == small


@pytest.mark.parametrize("size", [300_000, (1 << 20) - 64])
def test_a_get_payload_that_comes_in_pieces_reaches_both_clients_whole(size: int) -> None:
    """A node whose reply arrives in pieces with pauses (under and over the clients'
    receive marks: the sync client's MSG_WAITALL receives, the async client's
    SO_RCVLOWAT): both read the exact value, and the next call on the same connection
    works (a mark left set would stall it)."""
    node = LyingNode()
    node.dribble = 0.02
    key, small_key = os.urandom(16), os.urandom(16)
    value, small = os.urandom(size), os.urandom(100)
    try:
        with Client(node.url, shm=False) as client:
            client.put(key, value)
            client.put(small_key, small)
            buf = bytearray(size)
            for _ in range(2):
                assert client.get_into(key, buf) == size and buf == value
                assert client.get(small_key) == small

        async def run() -> None:
            async with AsyncClient(node.url, shm=False) as aclient:
                for _ in range(2):
                    abuf = bytearray(size)
                    assert await aclient.get_into(key, abuf) == size and abuf == value
                    assert await aclient.get(small_key) == small

        asyncio.run(run())
    finally:
        node.close()


def test_a_skipped_value_is_received_half_a_mib_at_a_time_and_counted_as_to_come() -> None:
    """A value nobody keeps (a PUT with no room for it, a GET reply the caller's buffer
    cannot take) is received straight into a discard buffer, up to 512 KiB a receive
    (through the 64 KiB scratch it took a wake-up and a receive a 64 KiB), and its bytes
    still to come are what a mark may wait for; what follows it parses as before."""
    size = (1 << 20) + 10
    got: list[bytes] = []

    def plan() -> Plan:
        got.append(bytes((yield Exact(4)) or b""))
        yield Skip(size)
        got.append(bytes((yield Exact(4)) or b""))
        yield Exact(1)  # (a plan never ends: the next frame's header)

    reader = StreamReader(plan())
    reader.feed(b"head")
    assert reader.into_left == size
    receives = 0
    left = size
    while left:
        buf = reader.get_buffer()
        assert len(buf) == min(left, 512 << 10)
        receives += 1
        left -= len(buf)
        if left:
            assert reader.more_of_value(len(buf))  # no parse step until the last receive
            assert reader.into_left == left
        else:
            reader.buffer_updated(len(buf))
    assert receives == 3 and reader.into_left == 0
    reader.feed(b"tail")
    assert got == [b"head", b"tail"]


def test_a_skip_that_starts_in_scratch_goes_on_in_the_discard_buffer() -> None:
    got: list[bytes] = []

    def plan() -> Plan:
        yield Exact(1)
        yield Skip(100_000)
        got.append(bytes((yield Exact(3)) or b""))
        yield Exact(1)

    reader = StreamReader(plan())
    reader.feed(bytes(1001))  # the skip's first bytes came through scratch
    assert reader.into_left == 99_000
    buf = reader.get_buffer()
    assert len(buf) == 99_000
    reader.buffer_updated(len(buf))
    reader.feed(b"end")
    assert got == [b"end"]


@linux_only
def test_a_put_refused_for_room_and_sent_in_pieces_leaves_the_next_frame_whole(
        small_node: NodeProcess) -> None:
    """DRAM full of pinned chunks: a 500 KiB value dribbled in with pauses is refused
    (NO_CAPACITY, its bytes skipped under the receive mark), and a small PUT right
    behind it is stored."""
    with Client(small_node.url, shm=False) as client:
        for _ in range(2):
            client.put(os.urandom(16), os.urandom(400 << 10), pin=True)
    big_key, small_key = os.urandom(16), os.urandom(16)
    big, small = os.urandom(500 << 10), os.urandom(4096)
    stream = hello_and_two_puts(big_key, big, small_key, small)
    frames = dribble(small_node, stream,
                     [100, 20_000, 200_000, 300_000, len(stream) - 5000, len(stream) - 10])
    assert [h.request_id for h, _ in frames] == [1, 2, 3]
    # a PUT's reply body: a status a item
    assert [body for _, body in frames[1:]] == [bytes([Status.NO_CAPACITY]), bytes([Status.OK])]
    with Client(small_node.url, shm=False) as client:
        assert client.get(big_key) is None
        assert client.get(small_key) == small
