"""A second one-sided transport, written in this one module: the proof that
``kvpool.client.paths`` is a seam (DESIGN.md's target: the same-host arena path is its
first implementation; RDMA, UCX or NIXL would be the next).

:class:`MemoryTransport` is the mock transport (nodes answered in this process) with a
one-sided path of its own, :class:`MemoryPath`: at HELLO a node grants its store (memory
in this process, as an RDMA node would register a region and hand out its key), and the
client reads values out of it with no GET request, verifying each envelope's checksum
as the arena path does; misses, and every put, go over the node's connection by the op
plans (the path's own fallback). Reads are reported to the node later in one batch, as
the arena path's TOUCH. Nothing in ``kvpool`` names this module.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from kvpool.client import AsyncClient, Client
from kvpool.client import _plans as plans
from kvpool.client._connection import Connection
from kvpool.client._shm_put import AheadHolder, ArenaHost
from kvpool.client.paths import BlockingGets, NodePath, OneSidedTransport
from kvpool.protocol.envelope import open_envelope
from kvpool.protocol.errors import CorruptChunkError
from kvpool.protocol.frames import KEY_SIZE, Op
from kvpool.protocol.parsers import Segments
from tests.conftest import NoLoop
from tests.mock_nodes import MockNode, MockNodes

Payloads = list[memoryview | Segments | None]


class MemoryReads:
    """Reads made with no request, reported to the node in one batch (``later``)."""

    def __init__(self, node: MockNode) -> None:
        self.node = node
        self.pending = 0

    @property
    def due(self) -> bool:
        return self.pending >= 64

    def later(self, conn: Connection | None = None) -> None:
        self.node.reported += self.pending  # type: ignore[attr-defined]
        self.pending = 0

    async def flush(self) -> None:
        self.later()

    def close(self) -> None:
        self.later()


class MemoryPath:
    """GETs read straight out of the granted region; misses and puts over the
    connection."""

    def __init__(self, node: ArenaHost, region_of: Callable[[], MockNode]) -> None:
        self.node = node
        self._region_of = region_of
        self._region: dict[bytes, bytes] | None = None
        self.touches = MemoryReads(region_of())
        self.shm_torn = 0
        self.index_hits = 0

    # -- the grant
    @property
    def asks_grant(self) -> bool:
        return True

    async def redeem(self, info: dict[str, Any], conn: Connection) -> None:
        self._region = self._region_of().store  # the "registered region"

    @property
    def grant(self) -> object | None:
        return self._region

    @property
    def writable(self) -> bool:
        return False

    def link_grant(self, info: dict[str, Any]) -> bool:
        return False

    def release(self) -> None:
        self._region = None

    def close(self) -> None:
        self.touches.close()

    # -- GETs: one-sided where the region has the value
    @property
    def carries_gets(self) -> bool:
        return self._region is not None

    @property
    def can_read_local(self) -> bool:
        return self._region is not None

    def read_local(self, blob: bytes, sinks: Sequence[memoryview | Segments] | None, *,
                   all_or_none: bool) -> tuple[Payloads, list[int]] | None:
        region = self._region
        assert region is not None
        count = len(blob) // KEY_SIZE
        out: Payloads = [None] * count
        rest: list[int] = []
        for i in range(count):
            stored = region.get(blob[i * KEY_SIZE : (i + 1) * KEY_SIZE])
            try:
                payload = open_envelope(stored) if stored is not None else None
            except CorruptChunkError:
                payload = None  # asked again over the connection, which drops it
            if payload is None:
                if all_or_none:
                    return None
                rest.append(i)
                continue
            out[i] = _into(payload, sinks[i] if sinks is not None else None)
        hits = count - len(rest)
        self.index_hits += hits
        self.touches.pending += hits
        return out, rest

    def get_here(self, blob: bytes, sinks: Sequence[memoryview | Segments] | None,
                 link: BlockingGets | None, before_read: Callable[[], bool]
                 ) -> Payloads | None:
        if self._region is None:
            return link.get(blob, sinks) if link is not None else None
        before_read()
        found = self.read_local(blob, sinks, all_or_none=link is None)
        if found is None:
            return None
        out, rest = found
        if rest:
            assert link is not None
            again = link.get(plans.rows_blob(blob, rest),
                             [sinks[i] for i in rest] if sinks is not None else None)
            for i, payload in zip(rest, again, strict=True):
                out[i] = payload
        return out

    def consume_local(self, key: bytes, fn: Callable[[memoryview], None]) -> bool:
        region = self._region
        stored = region.get(key) if region is not None else None
        if stored is None:
            return False
        fn(open_envelope(stored))
        return True

    async def get(self, conn: Connection, blob: bytes,
                  sinks: Sequence[memoryview | Segments] | None) -> Payloads:
        if self._region is None:
            return await self.node.run(plans.get_tcp(self.node, blob, sinks), conn)
        found = self.read_local(blob, sinks, all_or_none=False)
        assert found is not None
        out, rest = found
        if rest:
            again = await self.node.run(plans.get_tcp(
                self.node, plans.rows_blob(blob, rest),
                [sinks[i] for i in rest] if sinks is not None else None), conn)
            for i, payload in zip(rest, again, strict=True):
                out[i] = payload
        return out

    # -- puts: two-sided (the region takes no writes from this client)
    def carries_put(self, items: Sequence[plans.PutItem]) -> bool:
        return False

    async def put(self, conn: Connection, items: list[plans.PutItem], *, num_tokens: int,
                  fingerprint: bytes) -> list[int]:
        return await self.node.run(self.put_plan(conn, items, num_tokens=num_tokens,
                                                 fingerprint=fingerprint), conn)

    def put_plan(self, holder: AheadHolder, items: list[plans.PutItem], *, num_tokens: int,
                 fingerprint: bytes) -> plans.Plan[list[int]]:
        statuses = [0] * len(items)
        yield from plans.put_tcp(self.node, items, statuses, num_tokens=num_tokens,
                                 fingerprint=fingerprint)
        return statuses


def _into(payload: memoryview, sink: memoryview | Segments | None) -> memoryview | Segments:
    if sink is None:
        return memoryview(bytes(payload))
    if isinstance(sink, Segments):
        at = 0
        for view in sink.views:
            n = min(view.nbytes, payload.nbytes - at)
            view[:n] = payload[at : at + n]
            at += n
        sink.filled = at
        return sink
    sink[: payload.nbytes] = payload
    return sink[: payload.nbytes]


class MemoryTransport:
    """The mock transport of ``nodes``, with :class:`MemoryPath` as its one-sided path."""

    def __init__(self, nodes: MockNodes) -> None:
        self.nodes = nodes
        self.mock = nodes.transport

    async def open(self, *args: Any) -> Connection:
        return await self.mock.open(*args)

    def open_blocking(self, *args: Any) -> Any:
        return self.mock.open_blocking(*args)

    def one_sided(self, node: ArenaHost) -> NodePath:
        return MemoryPath(node, lambda: self.nodes.nodes[f"{node.host}:{node.port}"])


def _node() -> tuple[MockNodes, MockNode]:
    node = MockNode("solo")
    node.reported = 0  # type: ignore[attr-defined]
    return MockNodes({"127.0.0.1:7700": node}), node


def test_a_transport_with_its_own_one_sided_path_carries_the_async_clients_gets() -> None:
    nodes, node = _node()
    transport = MemoryTransport(nodes)
    assert isinstance(transport, OneSidedTransport)
    keys = [os.urandom(16) for _ in range(6)]
    values = [os.urandom(1000 + i) for i in range(6)]

    async def main() -> None:
        async with AsyncClient("127.0.0.1:7700", transport=transport) as c:
            path = c.router.standalone_node.path  # type: ignore[union-attr]
            assert isinstance(path, MemoryPath) and path.grant is node.store
            await c.put_many(keys[:4], values[:4])  # two-sided: PUT frames
            assert [op for op, _ in node.seen].count(Op.PUT) == 1
            gets_before = [op for op, _ in node.seen].count(Op.GET)
            # four values read out of the region with no request, two misses asked
            assert await c.get_many(keys) == [*values[:4], None, None]
            assert [op for op, _ in node.seen].count(Op.GET) == gets_before + 1
            assert node.seen[-1] == (Op.GET, 2)
            buffers = [bytearray(1100) for _ in range(2)]
            split = [memoryview(buffers[1])[:10], memoryview(buffers[1])[10:]]
            assert await c.get_many_into(keys[:2], [buffers[0], split]) == [1000, 1001]
            assert buffers[0][:1000] == values[0] and buffers[1][:1001] == values[1]
            assert c.shm_index_hits == 6
            seen: list[bytes] = []
            assert c.read_in_place(keys[2], lambda view: seen.append(bytes(view)))
            assert seen == [values[2]]
        assert node.reported == 6  # type: ignore[attr-defined]  # reported at close

    asyncio.run(main())


def test_a_corrupt_value_in_the_region_is_asked_for_over_the_connection() -> None:
    nodes, node = _node()
    key = os.urandom(16)
    with Client("127.0.0.1:7700", transport=MemoryTransport(nodes)) as c:
        c.put(key, b"x" * 500)
        stored = bytearray(node.store[key])
        stored[-1] ^= 1
        node.store[key] = bytes(stored)
        gets_before = [op for op, _ in node.seen].count(Op.GET)
        assert c.get(key) is None  # the mock node hands the same bad bytes over TCP
        assert [op for op, _ in node.seen].count(Op.GET) == gets_before + 1
        assert c.async_client.num_corrupt == 1


def test_the_sync_client_reads_through_the_path_in_its_own_thread() -> None:
    """The loop-free routes ask the path too: a GET the region answers runs no event
    loop and sends no frame; a miss goes over the blocking link, still with no loop."""
    nodes, node = _node()
    keys = [os.urandom(16) for _ in range(3)]
    with Client("127.0.0.1:7700", transport=MemoryTransport(nodes)) as c:
        c.put_many(keys[:2], [b"a" * 100, b"b" * 200])
        loop = c._free.loop
        c._free.loop = NoLoop(loop)  # type: ignore[assignment]
        # (the loop's own run before reads with no request, to report earlier ones, is
        # not what this checks: not due for a minute)
        c._free.loop_until = time.monotonic() + 60
        try:
            seen = len(node.seen)
            assert c.get_many(keys[:2]) == [b"a" * 100, b"b" * 200]
            assert len(node.seen) == seen  # no request at all
            assert c.get_many(keys) == [b"a" * 100, b"b" * 200, None]
            assert node.seen[seen:] == [(Op.GET, 1)]  # the miss, on the blocking link
        finally:
            c._free.loop = loop
        assert c.read_in_place(keys[1], lambda view: None) is True


@pytest.mark.parametrize("blocking", [True, False])
def test_a_node_that_left_gives_back_its_region(blocking: bool) -> None:
    nodes, node = _node()
    key = os.urandom(16)
    with Client("127.0.0.1:7700", transport=MemoryTransport(nodes), blocking=blocking) as c:
        c.put(key, b"v" * 64)
        path = c.async_client.router.standalone_node.path  # type: ignore[union-attr]
        assert path.grant is not None
        path.release()
        assert path.grant is None and not path.carries_gets
        seen = len(node.seen)
        hits = c.async_client.shm_index_hits
        assert c.get(key) == b"v" * 64  # over the connection now
        # (the blocking link says HELLO again: the grant it was opened under is gone)
        assert [seen_op for seen_op in node.seen[seen:] if seen_op[0] != Op.HELLO] \
            == [(Op.GET, 1)]
        assert c.async_client.shm_index_hits == hits
