"""Bad input gets a clear error, closes only that connection, and loses nothing."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest

from kvpool.client import Client
from kvpool.protocol.envelope import seal
from kvpool.protocol.errors import Status
from kvpool.protocol.frames import (
    FrameHeader,
    Op,
    PutItemHeader,
    encode_frame,
    encode_json,
    encode_keys_request,
)
from tests.conftest import NodeProcess, start_node


@pytest.fixture(scope="module")
def bad_node() -> Iterator[NodeProcess]:
    n = start_node("--dram-capacity", "16MiB", "--max-value", "1MiB", "--max-batch", "64")
    yield n
    assert n.stop() == 0  # still shuts down cleanly after all the abuse


@pytest.fixture
def witness(bad_node: NodeProcess) -> Iterator[tuple[Client, bytes, bytes]]:
    """A well-behaved client with data stored before the abuse; checked after it."""
    with Client(bad_node.url) as c:
        k, v = os.urandom(16), os.urandom(100_000)
        c.put(k, v)
        yield c, k, v
        assert c.get(k) == v  # same connection still works, data intact
        with Client(bad_node.url) as fresh:
            assert fresh.get(k) == v  # and the node accepts new connections


def connect(node: NodeProcess, hello: bool = True) -> socket.socket:
    s = socket.create_connection((node.host, node.port), timeout=5)
    if hello:
        s.sendall(b"".join(encode_frame(Op.HELLO, 1, [encode_json({"protocol": 1})])))
        header = FrameHeader.unpack(recv_exact(s, 24))
        assert header.status == Status.OK
        recv_exact(s, header.body_len)
    return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def error_then_close(s: socket.socket) -> tuple[int, str]:
    header = FrameHeader.unpack(recv_exact(s, 24))
    message = recv_exact(s, header.body_len).decode()
    assert s.recv(1) == b""  # the node closed this connection
    return header.status, message


def used_bytes(node: NodeProcess) -> int:
    with Client(node.url) as c:
        return int(c.stats()["tiers"]["dram"]["allocated_bytes"])


CASES = {
    "bad magic": (b"GARBAGE!" * 3, Status.BAD_FRAME, "magic"),
    "unknown opcode": (FrameHeader(31, 5, 0, 0).pack(), Status.UNKNOWN_OP, "opcode 31"),
    "key of wrong length": (FrameHeader(Op.GET, 5, 1, 15).pack() + b"k" * 15,
                            Status.BAD_FRAME, "16 body bytes"),
    "batch too large": (FrameHeader(Op.EXISTS, 5, 65, 65 * 16).pack(), Status.FRAME_TOO_LARGE,
                        "max_batch"),
    "value too large": (FrameHeader(Op.PUT, 5, 1, 32 + (2 << 20)).pack()
                        + PutItemHeader(b"k" * 16, 2 << 20).pack(), Status.VALUE_TOO_LARGE,
                        "max_value_bytes"),
    "malformed PUT": (FrameHeader(Op.PUT, 5, 1, 8).pack() + b"x" * 8, Status.BAD_FRAME, "PUT"),
    "non-JSON HELLO": (FrameHeader(Op.HELLO, 5, 0, 3).pack() + b"{{{", Status.BAD_FRAME, "JSON"),
    "STATS with a body": (FrameHeader(Op.STATS, 5, 0, 3).pack() + b"abc", Status.BAD_FRAME,
                          "no body"),
    "GET_SHM without a grant": (FrameHeader(Op.GET_SHM, 5, 1, 16).pack() + b"k" * 16,
                                Status.BAD_FRAME, "shared-memory arena"),
    "PUT_SHM without a grant": (FrameHeader(Op.PUT_SHM, 5, 1, 32).pack()
                                + PutItemHeader(b"k" * 16, 1000).pack(), Status.BAD_FRAME,
                                "arena for writing"),
    "COMMIT without a grant": (FrameHeader(Op.COMMIT, 5, 1, 8).pack() + bytes(8),
                               Status.BAD_FRAME, "arena for writing"),
    "traced frame too short": (FrameHeader(Op.GET | 0x80, 5, 0, 4).pack() + b"abcd",
                               Status.BAD_FRAME, "traced"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_frame_gets_error_and_close(bad_node: NodeProcess, witness: object,
                                        case: str) -> None:
    frame, status, message = CASES[case]
    s = connect(bad_node)
    s.sendall(frame)
    got_status, got_message = error_then_close(s)
    assert (got_status, message in got_message) == (status, True), got_message


def test_protocol_version_mismatch(bad_node: NodeProcess, witness: object) -> None:
    s = connect(bad_node, hello=False)
    s.sendall(b"".join(encode_frame(Op.HELLO, 1, [encode_json({"protocol": 99})])))
    status, message = error_then_close(s)
    assert status == Status.VERSION_MISMATCH and "protocol 1" in message


def test_first_frame_must_be_hello(bad_node: NodeProcess, witness: object) -> None:
    s = connect(bad_node, hello=False)
    s.sendall(b"".join(encode_keys_request(Op.GET, 1, [b"k" * 16])))
    status, message = error_then_close(s)
    assert status == Status.BAD_FRAME and "HELLO" in message


@pytest.mark.parametrize("cut", [10, 24 + 20, 24 + 32 + 64 + 50_000])
def test_disconnect_mid_frame_frees_memory(bad_node: NodeProcess, witness: object,
                                           cut: int) -> None:
    before = used_bytes(bad_node)
    payload = os.urandom(200_000)
    env = seal(payload)
    frame = b"".join(encode_frame(Op.PUT, 9, [
        PutItemHeader(os.urandom(16), len(env) + len(payload)).pack(), env, payload], count=1))
    s = connect(bad_node)
    s.sendall(frame[:cut])
    time.sleep(0.1)
    s.close()
    deadline = time.monotonic() + 5
    while used_bytes(bad_node) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert used_bytes(bad_node) == before


def test_corrupt_envelope_in_put_is_refused(bad_node: NodeProcess, witness: object) -> None:
    k = os.urandom(16)
    s = connect(bad_node)
    junk = b"\0" * 500
    s.sendall(b"".join(encode_frame(Op.PUT, 3, [PutItemHeader(k, 500).pack(), junk], count=1)))
    header = FrameHeader.unpack(recv_exact(s, 24))
    assert header.status == Status.OK
    assert recv_exact(s, header.body_len) == bytes([Status.CORRUPT])
    with Client(bad_node.url) as c:  # the connection stays usable; nothing was stored
        assert not c.exists(k)
    s.sendall(b"".join(encode_keys_request(Op.EXISTS, 4, [k])))
    assert FrameHeader.unpack(recv_exact(s, 24)).request_id == 4


def test_random_garbage_never_kills_the_node(bad_node: NodeProcess, witness: object) -> None:
    for seed in range(20):
        s = connect(bad_node, hello=seed % 2 == 0)
        s.sendall(os.urandom(50 + seed * 37))
        s.settimeout(5)
        try:
            while s.recv(65536):
                pass
        except (ConnectionError, TimeoutError):
            pass
        s.close()


def test_sigterm_with_open_connection_exits_cleanly() -> None:
    n = start_node("--dram-capacity", "4MiB")
    with Client(n.url) as c:
        c.put(os.urandom(16), b"x")
        assert n.stop() == 0


@pytest.mark.parametrize("shm", [False, True])
def test_bad_sdk_arguments_are_kvpool_value_errors_sent_nowhere(bad_node: NodeProcess,
                                                               shm: bool) -> None:
    """Out-of-range arguments fail before a byte is sent, as InvalidArgumentError (a
    KvpoolError and a ValueError), and the pooled connection stays usable."""
    import math

    from kvpool.client import InvalidArgumentError

    k = os.urandom(16)
    with Client(bad_node.url, shm=shm) as c:
        c.put(k, b"x" * 1000)
        strided = memoryview(bytearray(4000))[::2]
        calls = {
            "non-contiguous get_into": lambda: c.get_into(k, strided),
            "non-contiguous put": lambda: c.put(k, strided),
            "chunk_index -1": lambda: c.put(k, b"v", chunk_index=-1),
            "chunk_index 2**32": lambda: c.put(k, b"v", chunk_index=1 << 32),
            "num_tokens 2**32": lambda: c.put_many([k], [b"v"], num_tokens=1 << 32),
            "ttl inf": lambda: c.put(k, b"v", ttl=math.inf),
            "ttl nan": lambda: c.put(k, b"v", ttl=math.nan),
            "ttl past u32 ms": lambda: c.put(k, b"v", ttl=50 * 86400),
            "ttl 0": lambda: c.put(k, b"v", ttl=0),
        }
        for name, call in calls.items():
            with pytest.raises(InvalidArgumentError) as info:
                call()
            assert isinstance(info.value, ValueError), name
        assert c.get(k) == b"x" * 1000  # nothing was overwritten; the connection serves on
        c.put(k, b"y", ttl=49 * 86400)
        assert c.get(k) == b"y"
