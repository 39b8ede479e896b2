"""Nodes answered in this process, for the SDK's unit tests on a ``MockTransport``.

Each :class:`MockNode` keeps what PUTs sent (envelope and payload, as a node stores
them) in a dict and answers HELLO, CLUSTER, PUT, GET, EXISTS, LOOKUP and DELETE the
way ``server/data/handlers.py`` encodes them. Under a cluster map it refuses keys it does
not accept (WRONG_OWNER with its epoch) in frames routed by another epoch, as a
node does. Routing logic only: the real node is what every other test runs.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpool.client import MockTransport
from kvpool.client._connection import Buffer
from kvpool.placement.cluster_map import ClusterMap
from kvpool.protocol.errors import Status
from kvpool.protocol.frames import (
    PROTOCOL_VERSION,
    Op,
    Tier,
    encode_error,
    encode_frame,
    encode_json,
    encode_lookup_reply,
    encode_statuses,
    pack_get_item,
)
from kvpool.protocol.parsers import Request

__all__ = ["MockNode", "MockNodes"]


class MockNode:
    def __init__(self, node_id: str, max_batch: int = 4096) -> None:
        self.node_id = node_id
        self.max_batch = max_batch
        self.store: dict[bytes, bytes] = {}
        #: (op, item count) of every request answered
        self.seen: list[tuple[Op, int]] = []
        #: ops this node never answers (the client's deadline runs out)
        self.silent: set[Op] = set()

    def answer(self, request: Request, cmap: ClusterMap | None) -> Iterable[Buffer] | None:
        header = request.header
        op = Op(header.op)
        self.seen.append((op, header.count))
        epoch = cmap.epoch if cmap is not None else 0
        if op in self.silent:
            return None
        if op == Op.HELLO:
            return encode_frame(op, header.request_id, [encode_json({
                "protocol": PROTOCOL_VERSION, "node_id": self.node_id,
                "max_value_bytes": 1 << 20, "max_batch": self.max_batch,
                "max_frame_bytes": 64 << 20, "epoch": epoch, "cluster": cmap is not None,
                "idle_timeout_s": 0, "tenant": None, "role": "admin"})], epoch=epoch)
        if op == Op.CLUSTER:
            assert cmap is not None
            body = {**cmap.to_dict(), "node_id": self.node_id, "source": "mock"}
            return encode_frame(op, header.request_id, [encode_json(body)], epoch=epoch)
        keys = request.keys or [item.header.key for item in request.items]
        if cmap is not None and header.epoch != epoch and not cmap.accepts(self.node_id, keys):
            return encode_error(op, header.request_id, Status.WRONG_OWNER,
                                f"{self.node_id} does not own every key", epoch=epoch)
        body: list[Buffer] = []
        count = header.count
        if op == Op.PUT:
            for item in request.items:
                assert item.reservation is not None
                self.store[item.header.key] = bytes(item.reservation.view)
            body = [encode_statuses([Status.OK] * len(request.items))]
        elif op == Op.GET:
            for key in keys:
                value = self.store.get(key)
                body += [pack_get_item(Status.NOT_FOUND, 0)] if value is None else \
                    [pack_get_item(Status.OK, len(value)), value]
        elif op == Op.EXISTS:
            tiers = bytes(Tier.DRAM if key in self.store else 0 for key in keys)
            body = [bytes(Status.OK if t else Status.NOT_FOUND for t in tiers), tiers]
        elif op == Op.LOOKUP:
            held = [Tier.DRAM for _ in keys]
            for i, key in enumerate(keys):
                if key not in self.store:
                    held = held[:i]
                    break
            body, count = [encode_lookup_reply(held)], 1
        elif op == Op.DELETE:
            body = [encode_statuses([Status.OK if self.store.pop(key, None) is not None
                                     else Status.NOT_FOUND for key in keys])]
        else:
            return encode_error(op, header.request_id, Status.UNKNOWN_OP,
                                f"the mock node does not do {op.name}", epoch=epoch)
        return encode_frame(op, header.request_id, body, count=count, epoch=epoch)


class MockNodes:
    """Mock nodes by address, a :class:`MockTransport` to them, and the map they serve
    (None: one standalone node)."""

    def __init__(self, nodes: dict[str, MockNode], cmap: ClusterMap | None = None) -> None:
        self.nodes = nodes
        self.map = cmap
        self.transport = MockTransport(self.handle)

    def handle(self, address: str, request: Request) -> Iterable[Buffer] | None:
        return self.nodes[address].answer(request, self.map)

    def holders(self, key: bytes) -> set[str]:
        """The ids of the nodes that store ``key``."""
        return {node.node_id for node in self.nodes.values() if key in node.store}
