"""Hostile clients against a real node: fuzzed frames, slow-loris, unread replies, floods.

Each test keeps a witness: a well-behaved client whose data must be intact,
and whose connection must keep working, after the abuse.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.client import Client
from kvpool.protocol.envelope import seal
from kvpool.protocol.frames import (
    FrameHeader,
    Op,
    PutItemHeader,
    encode_frame,
    encode_json,
)
from tests.conftest import NodeProcess, start_node

HELLO = b"".join(encode_frame(Op.HELLO, 1, [encode_json({"protocol": 1})]))


@pytest.fixture(scope="module")
def fuzz_node() -> Iterator[NodeProcess]:
    n = start_node("--dram-capacity", "32MiB", "--max-value", "1MiB", "--max-batch", "64",
                   "--max-frame", "4MiB", "--no-ssd")
    yield n
    assert n.stop() == 0  # and it still shuts down cleanly


def valid_frames() -> list[bytes]:
    value = seal(b"p" * 300) + b"p" * 300
    return [
        b"".join(encode_frame(Op.PUT, 2, [PutItemHeader(b"f" * 16, len(value)).pack(), value],
                              count=1)),
        b"".join(encode_frame(Op.GET, 3, [b"f" * 16, b"g" * 16], count=2)),
        b"".join(encode_frame(Op.LOOKUP, 4, [b"f" * 16], count=1)),
        b"".join(encode_frame(Op.EXISTS, 5, [b"f" * 16], count=1)),
        b"".join(encode_frame(Op.PIN, 6, [b"f" * 16], count=1)),
        b"".join(encode_frame(Op.STATS, 7, [])),
        b"".join(encode_frame(Op.RELEASE, 8, [bytes(8)], count=1)),
        b"".join(encode_frame(Op.PUT_SHM, 9, [PutItemHeader(b"f" * 16, 364).pack()], count=1)),
        b"".join(encode_frame(Op.COMMIT, 10, [bytes(8)], count=1)),
    ]


@st.composite
def hostile_stream(draw: st.DrawFn) -> bytes:
    """Valid frames, mutated ones, headers with random fields, and plain noise."""
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["valid", "mutated", "header", "noise"]))
        if kind == "valid":
            parts.append(draw(st.sampled_from(valid_frames())))
        elif kind == "mutated":
            frame = bytearray(draw(st.sampled_from(valid_frames())))
            for _ in range(draw(st.integers(1, 6))):
                i = draw(st.integers(0, len(frame) - 1))
                frame[i] = draw(st.integers(0, 255))
            cut = draw(st.integers(0, len(frame)))
            parts.append(bytes(frame[:cut] if draw(st.booleans()) else frame))
        elif kind == "header":
            header = FrameHeader(draw(st.integers(0, 255)), draw(st.integers(0, 2**32 - 1)),
                                 draw(st.one_of(st.integers(0, 70), st.integers(0, 2**32 - 1))),
                                 draw(st.one_of(st.integers(0, 4096),
                                                st.integers(0, 2**64 - 1))),
                                 epoch=draw(st.integers(0, 2**32 - 1))).pack()
            parts.append(header + draw(st.binary(max_size=256)))
        else:
            parts.append(draw(st.binary(min_size=1, max_size=512)))
    return b"".join(parts)


def exchange(node: NodeProcess, data: bytes, hello: bool) -> None:
    """Send ``data`` (after HELLO, or as the first bytes), half-close, read to the end."""
    with socket.create_connection((node.host, node.port), timeout=10) as s:
        s.sendall((HELLO if hello else b"") + data)
        s.shutdown(socket.SHUT_WR)
        received = 0
        try:
            while chunk := s.recv(65536):
                received += len(chunk)
                assert received < 64 << 20  # replies are bounded by what was asked
        except ConnectionResetError:
            pass


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=hostile_stream(), hello=st.booleans())
def test_fuzzed_frames_never_hurt_the_node(fuzz_node: NodeProcess, data: bytes,
                                           hello: bool) -> None:
    """Each stream is answered and closed, and the node is still up after it (the next
    test checks its memory and the data of others)."""
    exchange(fuzz_node, data, hello)
    assert fuzz_node.proc.poll() is None, fuzz_node.output[-20:]


def test_after_fuzzing_memory_is_bounded_and_others_unaffected(fuzz_node: NodeProcess) -> None:
    """Runs after the fuzz test in this module: nothing leaked, witnesses intact."""
    with Client(fuzz_node.url, shm=False, pool_size=1) as witness:
        k, v = os.urandom(16), os.urandom(200_000)
        witness.put(k, v)
        before = psutil.Process(fuzz_node.proc.pid).memory_info().rss
        for seed in range(50):  # more abuse while the witness connection stays open
            exchange(fuzz_node, os.urandom(1000 + seed * 97), hello=seed % 2 == 0)
        assert witness.get(k) == v
        stats = witness.stats()
        # every connection but the witness's two is gone (its pooled one, which asked for
        # the stats, and the sync client's blocking one, which put and got), and nothing
        # they reserved is left
        assert stats["connections"]["open"] == 2
        dram = stats["tiers"]["dram"]
        assert dram["allocated_bytes"] <= dram["used_bytes"] + 4096 * dram["num_objects"]
        assert stats["protocol_errors"] > 0
        grown = psutil.Process(fuzz_node.proc.pid).memory_info().rss - before
        assert grown < 64 << 20, f"node RSS grew {grown >> 20} MiB under garbage"


@pytest.fixture
def strict_node() -> Iterator[NodeProcess]:
    n = start_node("--dram-capacity", "64MiB", "--no-ssd", "--idle-timeout", "1",
                   "--hello-timeout", "1", "--max-connections", "8")
    yield n
    n.stop()


def closed_within(s: socket.socket, seconds: float) -> bool:
    """True if the node closes ``s`` within ``seconds`` (bytes it sends are skipped)."""
    s.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not s.recv(1 << 20):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


def test_slow_and_silent_clients_time_out(strict_node: NodeProcess) -> None:
    node = strict_node
    with Client(node.url, shm=False, pool_size=1) as witness:
        k, v = os.urandom(16), os.urandom(100_000)
        witness.put(k, v)
        no_hello = socket.create_connection((node.host, node.port))
        assert closed_within(no_hello, 5)
        idle = socket.create_connection((node.host, node.port))
        idle.sendall(HELLO)
        assert closed_within(idle, 5)
        # slow-loris: a frame dripped one byte every 0.2 s never completes in 1 s
        drip = socket.create_connection((node.host, node.port))
        drip.sendall(HELLO)
        frame = b"".join(encode_frame(Op.GET, 9, [k], count=1))
        drip.settimeout(0.2)
        closed, sent = False, 0
        for byte in frame[:-1]:
            try:
                drip.sendall(bytes([byte]))
                sent += 1
                while drip.recv(4096):  # the HELLO reply
                    pass
                closed = True  # recv returned b"": the node closed it
                break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        # closed with most of the frame still to drip (a byte each 0.2 s or more): by the
        # node's frame timeout, not by anything the frame's end would have caused
        assert closed and sent < len(frame) // 2, (sent, len(frame))
        for s in (no_hello, idle, drip):
            s.close()
        # the witness was idle too, but a closed pooled connection just reconnects
        assert witness.get(k) == v
        assert witness.stats()["connections"]["timed_out"] >= 3


def test_client_that_never_reads_is_cut_off(strict_node: NodeProcess) -> None:
    node = strict_node
    with Client(node.url, shm=False, pool_size=1) as witness:
        k, v = os.urandom(16), os.urandom(1 << 20)
        witness.put(k, v)
        hog = socket.create_connection((node.host, node.port))
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hog.sendall(HELLO)
        get = b"".join(encode_frame(Op.GET, 2, [k], count=1))
        hog.settimeout(0.5)
        sent = 0
        try:
            for _ in range(200):  # asks for 200 MiB and reads none of it
                hog.sendall(get)
                sent += 1
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            pass  # the node stopped reading from us (backpressure), then closed
        assert witness.get(k) == v  # others are served meanwhile
        time.sleep(2.5)
        stats = witness.stats()
        assert stats["connections"]["timed_out"] >= 1
        assert stats["connections"]["open"] == 1  # the hog is gone
        # what the hog's unread replies held in DRAM is released
        assert stats["tiers"]["dram"]["num_objects"] == 1
        hog.close()


def test_connection_limit(strict_node: NodeProcess) -> None:
    node = strict_node
    keep = []
    for _ in range(8):
        s = socket.create_connection((node.host, node.port))
        s.sendall(HELLO)
        keep.append(s)
    time.sleep(0.2)
    extra = socket.create_connection((node.host, node.port))
    assert closed_within(extra, 2)  # refused at accept
    for s in keep:
        s.close()
    time.sleep(0.3)
    with Client(node.url, shm=False) as c:  # room again
        assert c.stats()["connections"]["rejected"] >= 1
