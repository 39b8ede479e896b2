"""Hostile or broken nodes against the SDK: no reply may crash a client, size its memory,
or make it answer the impossible (STYLE habit 15).

Every case talks over real sockets to :class:`tests.hostile_node.LyingNode`, which
answers as a node does and then rewrites its reply. A lie is a
:class:`~kvpool.protocol.errors.BadReplyError` (or another kvpool error) naming the
node; the fuzzer at the end rewrites replies at random, through the sync and the
async client, and allows nothing else.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.client import AsyncClient, BadReplyError, Client, KvpoolError
from kvpool.placement.cluster_map import ClusterMap, NodeInfo
from kvpool.protocol.envelope import EnvelopeHeader
from kvpool.protocol.frames import FRAME_HEADER_SIZE, Op, Tier, encode_lookup_reply
from kvpool.protocol.parsers import Request
from tests.hostile_node import LyingNode, Tamper, hello_with, set_header, untouched
from tests.mock_nodes import MockNode, MockNodes

KEYS = [bytes([i + 1]) * 16 for i in range(4)]
VALUES = [bytes([i + 1]) * (1000 + i) for i in range(4)]
TIMEOUT = 2.0


@pytest.fixture
def liar() -> Iterator[LyingNode]:
    node = LyingNode()
    yield node
    node.close()


def only(op: Op, change: Tamper) -> Tamper:
    """``change`` applied to the replies to ``op``; every other reply honest."""
    return lambda got, reply: change(got, reply) if got == op else reply


def stored(liar: LyingNode) -> None:
    with Client(liar.url, timeout=TIMEOUT) as kv:
        kv.put_many(KEYS, VALUES)
    liar.drop_connections()


def one_more_item(_op: Op, reply: bytes) -> bytes:
    extra = struct.pack("<B7xQ", 1, 0)  # a NOT_FOUND item the request never asked for
    body_len = len(reply) - FRAME_HEADER_SIZE + len(extra)
    count = struct.unpack_from("<I", reply, 8)[0]
    return set_header(reply, count=count + 1, body_len=body_len) + extra


def one_fewer_item(_op: Op, reply: bytes) -> bytes:
    # the honest reply's last item is a miss: a 16-byte item header and no value
    count = struct.unpack_from("<I", reply, 8)[0]
    return set_header(reply[:-16], count=count - 1, body_len=len(reply) - 16 - FRAME_HEADER_SIZE)


@pytest.mark.parametrize("lie", [one_more_item, one_fewer_item], ids=["more", "fewer"])
def test_a_get_reply_with_another_item_count_is_a_bad_reply(liar: LyingNode, lie: Tamper
                                                            ) -> None:
    stored(liar)
    keys = [*KEYS[:2], b"\x7f" * 16]  # the last one missing: its item is a 16-byte miss
    liar.tamper = only(Op.GET, lie)
    with Client(liar.url, timeout=TIMEOUT) as kv, \
            pytest.raises(BadReplyError, match=r"127\.0\.0\.1"):
        kv.get_many(keys)

    async def main() -> None:
        async with AsyncClient(liar.url, timeout=TIMEOUT) as kv:
            with pytest.raises(BadReplyError, match=r"127\.0\.0\.1"):
                await kv.get_many(keys)
            buffers = [bytearray(2000) for _ in keys]
            with pytest.raises(BadReplyError):
                await kv.get_many_into(keys, buffers)

    asyncio.run(main())


@pytest.mark.parametrize("changes", [{"max_batch": 0}, {"max_batch": "many"},
                                     {"max_batch": ...}, {"max_value_bytes": 1 << 62},
                                     {"max_frame_bytes": -1}, {"idle_timeout_s": "soon"},
                                     {"protocol": 99}],
                         ids=["zero", "string", "missing", "huge-values", "negative-frame",
                              "idle-string", "protocol"])
def test_a_hello_with_limits_out_of_range_is_a_bad_reply(liar: LyingNode,
                                                          changes: dict[str, Any]) -> None:
    liar.tamper = only(Op.HELLO, lambda _op, reply: hello_with(reply, **changes))
    with pytest.raises(BadReplyError, match="HELLO"), Client(liar.url, timeout=TIMEOUT) as kv:
        kv.get_many(KEYS)

    async def main() -> None:
        with pytest.raises(BadReplyError, match="HELLO"):
            async with AsyncClient(liar.url, timeout=TIMEOUT) as kv:
                await kv.lookup(KEYS)

    asyncio.run(main())


def test_a_cluster_map_with_an_absurd_weight_is_refused_before_any_ring_is_built() -> None:
    def heavy(_op: Op, reply: bytes) -> bytes:
        data = json.loads(reply[FRAME_HEADER_SIZE:])
        data["nodes"][0]["weight"] = 1e6  # a ring of two billion points, 15 GiB
        body = json.dumps(data).encode()
        return set_header(reply[:FRAME_HEADER_SIZE], body_len=len(body)) + body

    liar = LyingNode(only(Op.CLUSTER, heavy), cluster=True)
    try:
        with pytest.raises(BadReplyError, match="weight"), Client(liar.url, timeout=TIMEOUT):
            pass
    finally:
        liar.close()


def claims_1000(_op: Op, reply: bytes) -> bytes:
    """A LOOKUP reply that says 1000 leading keys were found, whatever was asked."""
    body = encode_lookup_reply([Tier.DRAM] * 1000)
    return set_header(reply[:FRAME_HEADER_SIZE], body_len=len(body)) + body


def test_a_lookup_that_finds_more_than_was_asked_is_a_bad_reply(liar: LyingNode) -> None:
    stored(liar)
    liar.tamper = only(Op.LOOKUP, claims_1000)
    with Client(liar.url, timeout=TIMEOUT) as kv, pytest.raises(BadReplyError, match="1000"):
        kv.lookup(KEYS)


def test_a_value_longer_than_the_nodes_own_limit_is_not_allocated(liar: LyingNode) -> None:
    """A GET item that claims 2**40 bytes: refused before any buffer of that size."""
    stored(liar)

    def enormous(_op: Op, reply: bytes) -> bytes:
        head = reply[: FRAME_HEADER_SIZE]
        size = 1 << 40
        envelope = EnvelopeHeader(raw_len=size, stored_len=size, checksum=0).pack()
        item = struct.pack("<B7xQ", 0, len(envelope) + size)
        return set_header(head, count=1, body_len=len(item) + len(envelope) + size) + item \
            + envelope + b"x" * 64

    liar.tamper = only(Op.GET, enormous)
    with Client(liar.url, timeout=TIMEOUT) as kv, pytest.raises(KvpoolError, match="max_value"):
        kv.get(KEYS[0])


# -- the fuzzer -----------------------------------------------------------------------------

_TARGETS = [Op.HELLO, Op.GET, Op.EXISTS, Op.LOOKUP, Op.PUT, Op.DELETE]


@st.composite
def lies(draw: st.DrawFn) -> tuple[Op, str, int, int]:
    """Which reply to rewrite (its op), how, and two numbers the rewrite uses."""
    return (draw(st.sampled_from(_TARGETS)),
            draw(st.sampled_from(REWRITES)),
            draw(st.integers(0, 1 << 16)), draw(st.integers(0, 255)))


#: the ways :func:`rewrite` changes a reply
REWRITES = ("byte", "truncate", "extend", "count", "body_len", "status", "op")


def random_rewrites(seed: int, count: int) -> list[tuple[str, int, int]]:
    """``count`` seeded arguments for :func:`rewrite` (how, n, byte): a fuzzer outside
    hypothesis, for the engine drivers that run in a process of their own."""
    rng = random.Random(seed)
    return [(rng.choice(REWRITES), rng.randrange(1 << 16), rng.randrange(256))
            for _ in range(count)]


class HalfLies:
    """A LyingNode tamper that rewrites about half the replies (a seeded coin, whatever
    their op) with :func:`random_rewrites`, until those run out; counts replies and lies."""

    def __init__(self, seed: int, count: int = 40) -> None:
        self.lies = random_rewrites(seed, count)
        self.coin = random.Random(seed + 1)
        self.replies = self.told = 0

    def __call__(self, _op: Op, reply: bytes) -> bytes:
        self.replies += 1
        if self.coin.random() < 0.5 or self.told >= len(self.lies):
            return reply
        self.told += 1
        return rewrite(reply, *self.lies[self.told - 1])


def rewrite(reply: bytes, how: str, n: int, byte: int) -> bytes:
    if how == "byte":
        pos = n % len(reply)
        return reply[:pos] + bytes([byte]) + reply[pos + 1:]
    if how == "truncate":
        return reply[: n % len(reply)]
    if how == "extend":
        return reply + bytes([byte]) * (n % 64 + 1)
    if how == "count":
        return set_header(reply, count=n)
    if how == "body_len":
        return set_header(reply, body_len=n)
    if how == "status":
        return set_header(reply, status=byte)
    return set_header(reply, op=byte)


def first_lie(target: Op, how: str, n: int, byte: int) -> Tamper:
    """Rewrite the first reply to ``target`` only (a node that lies once, then is honest)."""
    told = [False]

    def tamper(op: Op, reply: bytes) -> bytes:
        if op != target or told[0]:
            return reply
        told[0] = True
        return rewrite(reply, how, n, byte)

    return tamper


def check_sync(url: str) -> None:
    """Every call: a sane answer or a kvpool error, nothing else."""
    with Client(url, timeout=TIMEOUT) as kv:
        for call in range(6):
            try:
                if call == 0:
                    kv.put_many(KEYS, VALUES)
                elif call == 1:
                    got = kv.get_many(KEYS)
                    assert len(got) == len(KEYS)
                    assert all(g is None or bytes(g) == v for g, v in zip(got, VALUES,
                                                                          strict=True))
                elif call == 2:
                    buffers = [bytearray(1500) for _ in KEYS]
                    sizes = kv.get_many_into(KEYS, buffers)
                    assert len(sizes) == len(KEYS)
                    for size, buf, value in zip(sizes, buffers, VALUES, strict=True):
                        assert size is None or (size == len(value) and buf[:size] == value)
                elif call == 3:
                    found = kv.exists_many(KEYS)
                    assert len(found) == len(KEYS) and all(isinstance(f, bool) for f in found)
                elif call == 4:
                    assert 0 <= kv.lookup(KEYS) <= len(KEYS)
                else:
                    assert len(kv.delete_many(KEYS)) == len(KEYS)
            except KvpoolError:
                pass


async def check_async(url: str) -> None:
    async with AsyncClient(url, timeout=TIMEOUT) as kv:
        for call in range(5):
            try:
                if call == 0:
                    await kv.put_many(KEYS, VALUES)
                elif call == 1:
                    got = await kv.get_many(KEYS)
                    assert len(got) == len(KEYS)
                    assert all(g is None or bytes(g) == v for g, v in zip(got, VALUES,
                                                                          strict=True))
                elif call == 2:
                    found = await kv.exists_many(KEYS)
                    assert len(found) == len(KEYS)
                elif call == 3:
                    assert 0 <= await kv.lookup(KEYS) <= len(KEYS)
                else:
                    assert len(await kv.delete_many(KEYS)) == len(KEYS)
            except KvpoolError:
                pass


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(lie=lies())
def test_fuzzed_replies_give_sane_answers_or_kvpool_errors(lie: tuple[Op, str, int, int]
                                                           ) -> None:
    for client in ("sync", "async"):
        liar = LyingNode(close_after_lie=True)
        try:
            stored(liar)
            liar.tamper = first_lie(*lie)
            if client == "sync":
                check_sync(liar.url)
            else:
                asyncio.run(check_async(liar.url))
        except KvpoolError:
            pass  # the HELLO of connect() itself was the lie
        finally:
            liar.close()


def test_the_liar_is_honest_without_a_tamper(liar: LyingNode) -> None:
    """The harness itself: untouched replies serve the clients as a node would."""
    liar.tamper = untouched
    stored(liar)
    with Client(liar.url, timeout=TIMEOUT) as kv:
        assert [bytes(v) for v in kv.get_many(KEYS) if v is not None] == VALUES
        assert kv.lookup(KEYS) == len(KEYS)


# -- failover: a node that lies is a node that failed -----------------------------------

@pytest.mark.parametrize("blocking", [True, False])
def test_a_node_whose_get_reply_lies_is_failed_over_to_its_replica(blocking: bool) -> None:
    """Two nodes, two copies of every key; one node answers GETs with an item too many.
    Its keys are read from the other node, and it is marked down (routing logic only: a
    mock transport, on which ``tests/mock_nodes.py`` answers as a node)."""
    infos = (NodeInfo(id="honest", data="10.0.0.1:7700"), NodeInfo(id="liar",
                                                                   data="10.0.0.2:7700"))
    cmap = ClusterMap(epoch=1, nodes=infos, replication=2, fallbacks=0)
    mock = MockNodes({info.data: MockNode(info.id) for info in infos}, cmap)
    honest_answer = mock.handle

    def handle(address: str, request: Request) -> Any:
        reply = honest_answer(address, request)
        if address != "10.0.0.2:7700" or request.header.op != Op.GET or reply is None:
            return reply
        return [one_more_item(Op.GET, b"".join(reply))]

    mock.transport.handler = handle
    keys = [os.urandom(16) for _ in range(16)]
    values = [os.urandom(64 + i) for i in range(16)]
    with Client("10.0.0.1:7700", transport=mock.transport, blocking=blocking) as kv:
        kv.put_many(keys, values)
        assert all(set(mock.holders(k)) == {"honest", "liar"} for k in keys)
        assert kv.get_many(keys) == values
        liar = kv.async_client._router.nodes["liar"]
        assert not liar.live, "the node that lied was not marked down"
