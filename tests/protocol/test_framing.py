"""Framing is pure: every frame parses the same however the stream is split."""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.protocol.envelope import seal
from kvpool.protocol.errors import (
    MESSAGE_LIMIT,
    BadFrameError,
    FrameTooLargeError,
    Status,
    UnknownOpcodeError,
    ValueTooLargeError,
    error_for_status,
    status_for_error,
)
from kvpool.protocol.frames import (
    OP_FLAG_RAW,
    OP_FLAG_SHARED,
    OP_FLAG_TRACE,
    OP_SCOPE_MASK,
    PUT_FLAG_PARENT,
    PUT_FLAG_PIN,
    FrameHeader,
    GetItemHeader,
    Op,
    PutItemHeader,
    decode_lookup,
    encode_error,
    encode_frame,
    encode_json,
    encode_keys_request,
    encode_lookup_reply,
    pack_trace_context,
)
from kvpool.protocol.parsers import (
    BytesReservation,
    Limits,
    ReplyParser,
    RequestParser,
    Segments,
)

KEYS = [bytes([i]) * 16 for i in range(3)]


def put_frame(request_id: int, values: list[bytes]) -> bytes:
    body: list[bytes] = []
    for i, (key, payload) in enumerate(zip(KEYS, values, strict=False)):
        env = seal(payload)
        if i == 1:  # the second item names its parent (the first key)
            body += [PutItemHeader(key, len(env) + len(payload), 1500,
                                   PUT_FLAG_PIN | PUT_FLAG_PARENT).pack(), KEYS[0], env, payload]
        else:
            body += [PutItemHeader(key, len(env) + len(payload), 1500, 1).pack(), env, payload]
    return b"".join(encode_frame(Op.PUT, request_id, body, count=len(values)))


def request_stream() -> bytes:
    return b"".join([
        *encode_frame(Op.HELLO, 1, [encode_json({"protocol": 1})]),
        put_frame(2, [b"a" * 10, os.urandom(70_000), b""]),
        *encode_keys_request(Op.GET, 3, KEYS),
        *encode_keys_request(Op.LOOKUP, 4, KEYS[:2]),
        *encode_frame(Op.STATS, 5),
    ])


def check_requests(requests: list) -> None:  # type: ignore[type-arg]
    assert [r.header.op for r in requests] == [Op.HELLO, Op.PUT, Op.GET, Op.LOOKUP, Op.STATS]
    assert [r.header.request_id for r in requests] == [1, 2, 3, 4, 5]
    put = requests[1]
    assert [i.header.key for i in put.items] == KEYS
    assert [i.header.ttl_ms for i in put.items] == [1500] * 3
    assert [i.parent for i in put.items] == [None, KEYS[0], None]
    assert bytes(put.items[0].reservation.view[64:]) == b"a" * 10
    assert len(put.items[1].reservation.view) == 64 + 70_000
    assert list(requests[2].keys) == KEYS


def test_request_stream_whole() -> None:
    check_requests(RequestParser().feed(request_stream()))


def test_request_stream_split_at_every_byte() -> None:
    stream = request_stream()
    # every split point of the small frames, a sample inside the 70 KB value
    points = [*range(0, 400), *range(400, len(stream), 997), len(stream) - 1]
    for cut in points:
        parser = RequestParser()
        got = parser.feed(stream[:cut]) + parser.feed(stream[cut:])
        check_requests(got)


@given(st.lists(st.integers(min_value=1, max_value=5000), min_size=1, max_size=60))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_request_stream_random_pieces(sizes: list[int]) -> None:
    stream = request_stream()
    parser = RequestParser()
    got, pos, i = [], 0, 0
    while pos < len(stream):
        n = sizes[i % len(sizes)]
        got += parser.feed(stream[pos : pos + n])
        pos += n
        i += 1
    check_requests(got)


def key_op_stream() -> bytes:
    """Key ops of every kind, with scope bits, an epoch, one traced, 0 and 200 keys."""
    many = [os.urandom(16) for _ in range(200)]
    frames = [FrameHeader(op | scope, 10 + i, len(keys), 16 * len(keys), epoch=7).pack()
              + b"".join(keys)
              for i, (op, scope, keys) in enumerate([
                  (Op.GET, 0, KEYS), (Op.EXISTS, OP_FLAG_SHARED, many), (Op.LOOKUP, 0, []),
                  (Op.DELETE, OP_FLAG_RAW, KEYS[:1]), (Op.PIN, 0, KEYS), (Op.UNPIN, 0, KEYS),
                  (Op.GET_SHM, 0, KEYS[1:]), (Op.TOUCH, 0, KEYS)])]
    trace = pack_trace_context(5, 6, 1)
    frames.append(FrameHeader(Op.LOOKUP | OP_FLAG_TRACE, 30, 2, 16 * 2 + len(trace)).pack()
                  + trace + KEYS[0] + KEYS[1])
    return hello() + b"".join(frames)


def parsed(requests: list) -> list[tuple]:  # type: ignore[type-arg]
    return [((r.header.op, r.header.request_id, r.header.count, r.header.body_len,
              r.header.epoch), tuple(r.keys), bytes(r.body), r.scope, r.trace)
            for r in requests]


def test_a_key_op_whole_in_one_receive_parses_as_it_does_streamed() -> None:
    """The node parses a key op lying whole in its buffer in one pass (``_whole_frame``),
    the rest through the plan: the requests are the same either way."""
    stream = key_op_stream()
    whole = RequestParser().feed(stream)
    assert [r.header.op for r in whole[1:]] == [
        Op.GET, Op.EXISTS, Op.LOOKUP, Op.DELETE, Op.PIN, Op.UNPIN, Op.GET_SHM, Op.TOUCH,
        Op.LOOKUP]
    assert [r.scope for r in whole[1:4]] == [0, OP_FLAG_SHARED, 0]
    assert len(whole[2].keys) == 200 and whole[3].keys == () and whole[1].header.epoch == 7
    assert whole[-1].trace is not None and list(whole[-1].keys) == KEYS[:2]
    for step in (1, 7, 100):
        parser = RequestParser()
        streamed: list = []  # type: ignore[type-arg]
        for i in range(0, len(stream), step):
            streamed += parser.feed(stream[i : i + step])
        assert parsed(streamed) == parsed(whole)


@pytest.mark.parametrize("step", [None, 1])
def test_a_bad_key_op_is_refused_whole_or_streamed(step: int | None) -> None:
    for frame, error, match in [
            (FrameHeader(Op.GET, 2, 2, 33).pack() + bytes(33), BadFrameError, "frame says 33"),
            (FrameHeader(Op.EXISTS, 2, 5000, 5000 * 16).pack(), FrameTooLargeError,
             "max_batch"),
            (FrameHeader(Op.GET | OP_SCOPE_MASK, 2, 1, 16).pack() + KEYS[0],
             UnknownOpcodeError, "opcode")]:
        parser = RequestParser()
        stream = hello() + frame
        for i in range(0, len(stream), step or len(stream)):
            parser.feed(stream[i : i + (step or len(stream))])
            if parser.error is not None:
                break
        assert isinstance(parser.error, error) and match in str(parser.error)


def reply_stream(payloads: list[bytes]) -> bytes:
    body: list[bytes] = []
    for p in payloads:
        if p == b"<miss>":
            body.append(GetItemHeader(Status.NOT_FOUND, 0).pack())
            continue
        env = seal(p, chunk_index=1)
        body += [GetItemHeader(Status.OK, len(env) + len(p)).pack(), env, p]
    return b"".join([
        *encode_frame(Op.GET, 7, body, count=len(payloads)),
        *encode_frame(Op.LOOKUP, 8, [encode_lookup_reply([1, 2])], count=1),
        *encode_error(Op.GET, 9, Status.VALUE_TOO_LARGE, "too big"),
    ])


def test_reply_stream_split_at_every_byte() -> None:
    payloads = [b"hello", b"<miss>", os.urandom(9000)]
    stream = reply_stream(payloads)
    for cut in range(len(stream) + 1):
        parser = ReplyParser()
        replies = parser.feed(stream[:cut]) + parser.feed(stream[cut:])
        get, lookup, err = replies
        assert [i.status for i in get.items] == [Status.OK, Status.NOT_FOUND, Status.OK]
        assert bytes(get.items[0].payload) == b"hello"
        assert bytes(get.items[2].payload) == payloads[2]
        assert get.items[2].envelope.chunk_index == 1
        assert struct.unpack_from("<I", lookup.body)[0] == 2
        assert decode_lookup(lookup.body) == [1, 2]
        assert err.header.status == Status.VALUE_TOO_LARGE and bytes(err.body) == b"too big"


def test_replies_come_out_of_each_receive_as_a_transport_delivers_them() -> None:
    """As a transport drives it: get_buffer, a receive of at most 64 KiB, buffer_updated,
    and the replies taken after every receive; values bigger than the scratch buffer are
    received straight into their own buffer. (A reply of such a value was once appended
    to a list already taken, and lost, while ``feed`` of the whole stream found it.)"""
    payloads = [os.urandom(300_000), b"<miss>", os.urandom(70_000)]
    stream = memoryview(reply_stream(payloads))
    parser = ReplyParser()
    replies = []
    pos = 0
    while pos < len(stream):
        buf = parser.get_buffer(-1)
        n = min(len(buf), len(stream) - pos, 65536)
        buf[:n] = stream[pos : pos + n]
        pos += n
        replies += parser.buffer_updated(n)
    get, lookup, err = replies
    assert [i.status for i in get.items] == [Status.OK, Status.NOT_FOUND, Status.OK]
    assert bytes(get.items[0].payload) == payloads[0]
    assert bytes(get.items[2].payload) == payloads[2]
    assert decode_lookup(lookup.body) == [1, 2]
    assert err.header.status == Status.VALUE_TOO_LARGE


def test_a_reply_handed_out_is_not_kept_alive_by_the_parser() -> None:
    """A client that got a value of many MiB holds it only as long as it wants to."""
    import sys

    parser = ReplyParser()
    (get, _, _) = parser.feed(reply_stream([os.urandom(1 << 20)]))
    value = get.items[0].payload.obj
    del get
    assert sys.getrefcount(value) == 2  # ``value`` and getrefcount's argument: no other


def test_reply_into_caller_buffers_and_checksum() -> None:
    payload = os.urandom(5000)
    sink = memoryview(bytearray(6000))
    stream = reply_stream([payload])
    parser = ReplyParser(lambda rid, i, n: sink)
    (get, _, _) = parser.feed(stream)
    assert get.items[0].payload.obj is sink.obj
    assert bytes(sink[:5000]) == payload
    # flip one payload byte on the wire: reported corrupt, never OK
    bad = bytearray(stream)
    bad[24 + 16 + 64 + 100] ^= 1
    (get, _, _) = ReplyParser().feed(bad)
    assert get.items[0].status == Status.CORRUPT


def test_reply_buffer_too_small() -> None:
    from kvpool.protocol.parsers import TOO_SMALL

    sink = memoryview(bytearray(10))
    (get, _, _) = ReplyParser(lambda rid, i, n: sink).feed(reply_stream([b"x" * 11]))
    assert get.items[0].status == TOO_SMALL


def _items(replies: list) -> list[tuple[int, bytes | None]]:  # type: ignore[type-arg]
    out = []
    for item in replies[0].items:
        payload = item.payload
        if isinstance(payload, Segments):
            data = b"".join(bytes(v) for v in payload.views)[: payload.filled]
        else:
            data = bytes(payload) if payload is not None else None
        out.append((item.status, data))
    return out


@pytest.mark.parametrize("sinks", ["new", "buffers", "segments"])
def test_a_reply_whole_in_one_receive_parses_as_it_does_streamed(sinks: str) -> None:
    """A reply that arrives whole is parsed in one pass, a split one by the streamed plan:
    every kind of item comes out the same both ways (hits, misses, a flipped payload
    byte, a garbled envelope, a value shorter than an envelope, a buffer too small)."""
    from kvpool.protocol.parsers import TOO_SMALL

    good = [b"hello", os.urandom(3000)]
    flipped = bytearray(seal(b"z" * 100) + b"z" * 100)
    flipped[64 + 50] ^= 1
    garbled = bytearray(seal(b"q" * 40) + b"q" * 40)
    garbled[0] ^= 0xFF
    values = [seal(good[0]) + good[0], None, bytes(flipped), bytes(garbled), b"short",
              seal(good[1]) + good[1], seal(b"w" * 500) + b"w" * 500]
    body: list[bytes] = []
    for v in values:
        body += [GetItemHeader(Status.NOT_FOUND, 0).pack()] if v is None else \
            [GetItemHeader(Status.OK, len(v)).pack(), v]
    stream = b"".join(encode_frame(Op.GET, 3, body, count=len(values)))

    def parse(pieces: list[bytes]) -> list[tuple[int, bytes | None]]:
        def sink_for(_rid: int, i: int, n: int) -> memoryview | Segments | None:
            size = 200 if i == 6 else 4000  # the last value is 500 bytes: too small
            if sinks == "buffers":
                return memoryview(bytearray(size))
            if sinks == "segments":
                return Segments([memoryview(bytearray(7)), memoryview(bytearray(size))])
            return None

        parser = ReplyParser(sink_for)
        replies = [r for piece in pieces for r in parser.feed(piece)]
        assert len(replies) == 1
        return _items(replies)

    whole = parse([stream])
    streamed = parse([stream[i : i + 1] for i in range(len(stream))])
    assert whole == streamed
    last = (TOO_SMALL, None) if sinks != "new" else (Status.OK, b"w" * 500)
    assert whole == [(Status.OK, good[0]), (Status.NOT_FOUND, None), (Status.CORRUPT, None),
                     (Status.CORRUPT, None), (Status.CORRUPT, None), (Status.OK, good[1]),
                     last]


@pytest.mark.parametrize("cut", [None, 1])
def test_a_bad_get_reply_is_refused_whole_or_streamed(cut: int | None) -> None:
    item = GetItemHeader(Status.OK, 100).pack()
    for body, match in [([item, b"x" * 50], "runs past"), ([item[:8]], "shorter than"),
                        ([GetItemHeader(Status.NOT_FOUND, 0).pack(), b"junk"], "stray")]:
        stream = b"".join(encode_frame(Op.GET, 1, body, count=1))
        parser = ReplyParser()
        with pytest.raises(BadFrameError, match=match):
            for i in range(0, len(stream), cut or len(stream)):
                parser.feed(stream[i : i + (cut or len(stream))])


def hello() -> bytes:
    return b"".join(encode_frame(Op.HELLO, 1, [encode_json({"protocol": 1})]))


@pytest.mark.parametrize(("frame", "error"), [
    (b"XX" + bytes(22), BadFrameError),
    (FrameHeader(99, 1, 0, 0).pack(), UnknownOpcodeError),
    (FrameHeader(Op.GET, 1, 5000, 5000 * 16).pack(), FrameTooLargeError),
    (FrameHeader(Op.STATS, 1, 0, 1 << 40).pack(), FrameTooLargeError),
    (FrameHeader(Op.HELLO, 1, 0, 1 << 20).pack(), FrameTooLargeError),  # no 1 MiB JSON
    (FrameHeader(Op.GET, 1, 2, 33).pack(), BadFrameError),  # key of the wrong length
    (FrameHeader(Op.PUT, 1, 1, 10).pack(), BadFrameError),  # body shorter than an item
    (FrameHeader(Op.PUT, 1, 1, 40).pack() + PutItemHeader(KEYS[0], 100).pack(), BadFrameError),
    (FrameHeader(Op.PUT, 1, 1, 32 + (2 << 20)).pack()
     + PutItemHeader(KEYS[0], 2 << 20).pack(), ValueTooLargeError),
])
def test_bad_frames(frame: bytes, error: type[Exception]) -> None:
    parser = RequestParser(Limits(max_frame_bytes=64 << 20, max_batch=4096,
                                  max_value_bytes=1 << 20))
    assert len(parser.feed(hello())) == 1
    assert parser.feed(frame) == []
    assert isinstance(parser.error, error)


def test_put_shm_items_carry_no_values_and_reserve_nothing_while_parsed() -> None:
    reserved = []
    parser = RequestParser(
        reserve=lambda key, n, scope: reserved.append(n))  # type: ignore[func-returns-value]
    body = [PutItemHeader(KEYS[0], 5000, 0, 0).pack(),
            PutItemHeader(KEYS[1], 70_000, 250, PUT_FLAG_PIN | PUT_FLAG_PARENT).pack(), KEYS[0]]
    frame = b"".join(encode_frame(Op.PUT_SHM | 0x40, 2, body, count=2))  # shared scope
    commit = b"".join(encode_frame(Op.COMMIT, 3, [struct.pack("<Q", 7)], count=2))
    put, done = parser.feed(hello() + frame + commit)[1:]
    assert (put.header.op, put.scope) == (Op.PUT_SHM, 0x40)
    assert [(i.header.key, i.header.value_len, i.parent, i.reservation) for i in put.items] == [
        (KEYS[0], 5000, None, None), (KEYS[1], 70_000, KEYS[0], None)]
    assert reserved == []  # the node reserves once it knows the connection may write
    assert (done.header.op, done.header.count, bytes(done.body)) == (
        Op.COMMIT, 2, struct.pack("<Q", 7))


@pytest.mark.parametrize(("frame", "error"), [
    # one slot past max_frame_bytes (64 MiB here): a PUT_SHM reserves no more than a PUT carries
    (b"".join(encode_frame(Op.PUT_SHM, 1, [PutItemHeader(bytes([i]) * 16, 1 << 20).pack()
                                           for i in range(65)], count=65)), FrameTooLargeError),
    (FrameHeader(Op.PUT_SHM, 1, 1, 40).pack() + PutItemHeader(KEYS[0], 100).pack() + bytes(8),
     BadFrameError),  # stray bytes after the items
    (FrameHeader(Op.PUT_SHM, 1, 1, 32).pack() + PutItemHeader(KEYS[0], 2 << 20).pack(),
     ValueTooLargeError),
])
def test_bad_put_shm_frames(frame: bytes, error: type[Exception]) -> None:
    test_bad_frames(frame, error)


def test_nothing_behind_hello_is_parsed_until_the_owner_resumes() -> None:
    """A node must know who the peer is before it reserves memory for its PUT values."""
    reserved: list[tuple[int, int]] = []

    def reserve(key: bytes, n: int, scope: int) -> BytesReservation:
        reserved.append((n, scope))
        return BytesReservation(n)

    parser = RequestParser(reserve=reserve, hold_after_hello=True)
    stream = hello() + put_frame(2, [b"a" * 100]) + hello() + b"".join(
        encode_keys_request(Op.EXISTS, 4, KEYS[:1]))
    for cut in (len(stream), 30, len(hello()) + 10):  # in one read, and split mid-frame
        parser = RequestParser(reserve=reserve, hold_after_hello=True)
        reserved.clear()
        got = [r.header.op for r in parser.feed(stream[:cut])]
        assert got == ([Op.HELLO] if cut >= len(hello()) else [])
        assert reserved == [] and parser.holding == (cut >= len(hello()))
        if cut < len(stream):
            got += [r.header.op for r in parser.feed(stream[cut:])]
        while parser.holding:
            got += [r.header.op for r in parser.resume()]
        assert got == [Op.HELLO, Op.PUT, Op.HELLO, Op.EXISTS]
        assert reserved == [(64 + 100, 0)]
    with pytest.raises(RuntimeError):
        parser.resume()


def test_abort_releases_half_received_value() -> None:
    released = []

    class Res:
        def __init__(self, n: int) -> None:
            self.view = memoryview(bytearray(n))

        def release(self) -> None:
            released.append(len(self.view))

    parser = RequestParser(reserve=lambda key, n, scope: Res(n))
    frame = put_frame(2, [b"z" * 1000])
    assert parser.feed(frame[:-10]) == []
    assert parser.mid_frame
    parser.abort()
    assert released == [64 + 1000]


def test_full_node_skips_value_and_keeps_stream() -> None:
    parser = RequestParser(reserve=lambda key, n, scope: None)
    stream = put_frame(2, [b"a" * 100, b"b" * 100]) + b"".join(
        encode_keys_request(Op.EXISTS, 3, KEYS[:1]))
    put, exists = parser.feed(stream)
    assert [i.reservation for i in put.items] == [None, None]
    assert list(exists.keys) == KEYS[:1]


def test_status_table_roundtrip() -> None:
    for status in Status:
        if status in (Status.OK, Status.NOT_FOUND):
            continue
        assert status_for_error(error_for_status(status, "x")) == status


def test_a_node_error_message_is_one_short_printable_line() -> None:
    """A node that sends 16 KB of binary as its error message (a payload under a rewritten
    status) gives an error, and so a log line, of at most MESSAGE_LIMIT printable
    characters that says how much was cut; a node's ordinary message is kept whole."""
    garbage = bytes(range(256)).decode("latin-1") * 64
    for status in (141, int(Status.INTERNAL), int(Status.CORRUPT)):
        text = str(error_for_status(status, garbage))
        assert text.isprintable() and len(text) < MESSAGE_LIMIT + 80, text
        assert f"({len(garbage) - MESSAGE_LIMIT} more characters)" in text
    assert str(error_for_status(int(Status.CORRUPT), "chunk ab12 failed its checksum")) \
        == "chunk ab12 failed its checksum"
