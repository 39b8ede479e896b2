"""A PUT's checksum sent after its value (PUT_FLAG_CHECKSUM_AFTER): the envelope's and
the parser's part, the client's sending order, and a real node storing what readers
accept (and refusing to hand out a value whose trailer is wrong)."""

from __future__ import annotations

import asyncio
import os
import struct

import pytest
import xxhash

from kvpool.client import AsyncClient, Client
from kvpool.client._connection import trailer_runs
from kvpool.client._plans import TRAILER_MIN, PutItem, put_tcp
from kvpool.protocol.envelope import (
    ENVELOPE_HEADER_SIZE,
    ChecksumTrailer,
    EnvelopeHeader,
    fill_checksum,
    open_envelope,
    seal,
)
from kvpool.protocol.errors import BadFrameError, CorruptChunkError
from kvpool.protocol.frames import (
    CHECKSUM_TRAILER_SIZE,
    PUT_FLAG_CHECKSUM_AFTER,
    Op,
    PutItemHeader,
    encode_frame,
    encode_json,
)
from kvpool.protocol.parsers import RequestParser
from tests.conftest import NodeProcess, send_frames

KEY = bytes(range(16))


def trailer_bytes(payload: bytes) -> bytes:
    return struct.pack("<Q", xxhash.xxh3_64_intdigest(payload))


# -- the envelope's part -----------------------------------------------------------------


def test_a_deferred_seal_reads_nothing_and_a_trailer_hashes_whole_or_in_pieces() -> None:
    payload = os.urandom(300_000)
    assert EnvelopeHeader.unpack(seal(payload, deferred=True)).checksum == 0
    whole = ChecksumTrailer(payload)
    assert bytes(whole) == bytes(8)  # unfilled: a checksum no reader accepts
    whole.fill()
    pieces = ChecksumTrailer([payload[:1000], payload[1000:]])
    view = memoryview(payload)
    for start in range(0, len(payload), 4096):
        pieces.update(view[start : start + 4096])
    pieces.fill()
    assert bytes(whole) == bytes(pieces) == trailer_bytes(payload)
    partial = ChecksumTrailer(payload)
    partial.update(view[:10])
    with pytest.raises(RuntimeError, match="not hashed"):
        partial.fill()


def test_the_node_writes_the_trailer_into_the_stored_header() -> None:
    payload = os.urandom(5000)
    value = bytearray(seal(payload, chunk_index=3, num_tokens=16, deferred=True) + payload)
    fill_checksum(memoryview(value), trailer_bytes(payload))
    header = EnvelopeHeader.unpack(value)  # header_check renewed
    assert (header.checksum, header.chunk_index, header.num_tokens) == (
        xxhash.xxh3_64_intdigest(payload), 3, 16)
    assert bytes(open_envelope(value)) == payload
    # a header already broken as sent is left for the commit to refuse
    broken = bytearray(value)
    broken[40] ^= 1
    before = bytes(broken)
    fill_checksum(memoryview(broken), bytes(8))
    assert bytes(broken) == before
    with pytest.raises(CorruptChunkError):
        EnvelopeHeader.unpack(broken)


# -- the parser's part -------------------------------------------------------------------


class Slot:
    def __init__(self, n: int) -> None:
        self.view = memoryview(bytearray(n))

    def release(self) -> None:
        pass


def trailer_frame(payload: bytes, trailer: bytes, op: Op = Op.PUT) -> bytes:
    envelope = seal(payload, deferred=True)
    body = [PutItemHeader(KEY, len(envelope) + len(payload), 0,
                          PUT_FLAG_CHECKSUM_AFTER).pack()]
    if op == Op.PUT:
        body += [envelope, payload, trailer]
    return b"".join(encode_frame(op, 7, body, count=1))


def test_the_parser_fills_the_slot_from_the_trailer_in_any_pieces() -> None:
    payload = os.urandom(70_000)
    frame = trailer_frame(payload, trailer_bytes(payload))
    for step in (len(frame), 1000, 7):
        slots: list[Slot] = []

        def reserve(key: bytes, n: int, scope: int, slots: list[Slot] = slots) -> Slot:
            slots.append(Slot(n))
            return slots[-1]

        parser = RequestParser(reserve=reserve)
        requests = []
        for start in range(0, len(frame), step):
            requests += parser.feed(frame[start : start + step])
        assert len(requests) == 1 and len(slots) == 1
        assert bytes(open_envelope(slots[0].view)) == payload


def test_a_full_node_skips_the_trailer_with_the_value() -> None:
    payload = b"x" * 100
    stream = trailer_frame(payload, trailer_bytes(payload)) * 2
    parser = RequestParser(reserve=lambda key, n, scope: None)
    first, second = parser.feed(stream)
    assert [i.reservation for i in first.items + second.items] == [None, None]


def test_a_trailer_flag_without_a_value_or_without_room_for_it_is_refused() -> None:
    payload = b"z" * 100
    for frame, why in [(trailer_frame(b"y" * 10, b"", op=Op.PUT_SHM), "no value"),
                       # the body ends where the trailer should start
                       (trailer_frame(payload, b""), "runs past")]:
        parser = RequestParser(reserve=lambda key, n, scope: Slot(n))
        assert parser.feed(frame) == []
        assert isinstance(parser.error, BadFrameError)
        assert why in str(parser.error)


# -- the client's sending order ----------------------------------------------------------


def test_runs_hash_each_piece_after_it_is_sent_and_fill_the_trailer_before_it() -> None:
    big = os.urandom(3 * (1 << 20) + 5)
    small = os.urandom(1000)
    head, tail = b"H" * 24, b"T" * 32
    big_view = memoryview(big)
    big_trailer = ChecksumTrailer([big_view])
    parts = [head, big_view, big_trailer, tail, small]
    sent: list[bytes] = []
    for run in trailer_runs(parts):
        # a trailer goes out filled; before that, nothing of its value is hashed that was
        # not already handed to the sender
        for part in run:
            if type(part) is ChecksumTrailer:
                assert bytes(part) == trailer_bytes(big)
        sent.append(b"".join(bytes(p) for p in run))
    assert len(sent) >= 4  # the value went out in pieces
    assert b"".join(sent) == head + big + trailer_bytes(big) + tail + small
    assert list(trailer_runs([head, small])) == [[head, small]]
    with pytest.raises(ValueError, match="follow"):
        list(trailer_runs([ChecksumTrailer(small), small]))


class Host:
    node_id = "n1"

    def __init__(self, after: bool) -> None:
        self.put_bytes_by_path = {"tcp": 0}
        self.server_info = {"max_value_bytes": 64 << 20, "max_frame_bytes": 1 << 30,
                            "max_batch": 256}
        if after:
            self.server_info["checksum_after"] = True


@pytest.mark.parametrize("after", [True, False])
def test_only_large_values_to_a_node_that_takes_them_carry_a_trailer(after: bool) -> None:
    values = [os.urandom(TRAILER_MIN), os.urandom(TRAILER_MIN - 1)]
    items = []
    for i, value in enumerate(values):
        header = PutItemHeader(bytes([i]) * 16, ENVELOPE_HEADER_SIZE + len(value))
        items.append(PutItem(i, header, None, [memoryview(value)], len(value), 0))
    plan = put_tcp(Host(after), items, [0, 0], num_tokens=0, fingerprint=bytes(16))  # type: ignore[arg-type]
    ((op, count, body, _),) = next(plan)
    trailers = [p for p in body if type(p) is ChecksumTrailer]
    assert (op, count) == (Op.PUT, 2)
    assert len(trailers) == (1 if after else 0)
    flags = [PutItemHeader.unpack(p).flags for p in body
             if type(p) is bytes and len(p) == 32 and p[:16] in (bytes(16), bytes([1]) * 16)]
    assert flags == ([PUT_FLAG_CHECKSUM_AFTER, 0] if after else [0, 0])


# -- a real node -------------------------------------------------------------------------


@pytest.mark.parametrize("size", [TRAILER_MIN, 1 << 20, 5 * (1 << 20) + 3])
def test_sync_and_async_puts_with_trailers_read_back_whole(node: NodeProcess,
                                                            size: int) -> None:
    values = [os.urandom(size) for _ in range(3)]
    keys = [os.urandom(16) for _ in range(6)]
    with Client(node.url, shm=False) as client:
        client.put(keys[0], values[0])
        client.put_many(keys[1:3], values[1:])

    async def run() -> list[bytes | None]:
        async with AsyncClient(node.url, shm=False) as aclient:
            await aclient.put_many(keys[3:], values)
            return [None if v is None else bytes(v)
                    for v in await aclient.get_many(keys)]

    got = asyncio.run(run())
    assert got == [values[0], values[1], values[2], *values]


def test_a_wrong_trailer_is_stored_and_no_reader_accepts_it(node: NodeProcess) -> None:
    payload = os.urandom(100_000)
    bad = bytearray(trailer_bytes(payload))
    bad[0] ^= 1
    key = os.urandom(16)
    frame = trailer_frame(payload, bytes(bad)).replace(KEY, key, 1)
    send_frames(node, [*encode_frame(Op.HELLO, 1, [encode_json({"protocol": 1})]), frame],
                replies=2)
    with Client(node.url, shm=False) as client:
        assert client.exists(key)
        assert client.get(key) is None  # dropped as corrupt: a miss
        assert client.num_corrupt == 1
    assert len(bad) == CHECKSUM_TRAILER_SIZE
