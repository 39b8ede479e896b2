"""What each opcode does on a node: pure functions of a request and the tiers.

A handler returns the reply as a list of buffers (values are arena
memoryviews, never copied) plus the DRAM entries that must stay acquired
until those buffers have been written out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpool.protocol.errors import BadFrameError, Status, VersionMismatchError
from kvpool.protocol.frames import (
    PROTOCOL_VERSION,
    PUT_FLAG_PIN,
    GetItemHeader,
    Op,
    decode_json,
    encode_frame,
    encode_json,
    encode_lookup_reply,
    encode_statuses,
)
from kvpool.protocol.parsers import Limits, Request
from kvpool.server.stats import NodeStats
from kvpool.tiers.dram import DramTier, Entry, Slot

__all__ = ["Handlers", "Reply"]

Buffers = list[bytes | bytearray | memoryview]


@dataclass(slots=True)
class Reply:
    buffers: Buffers
    held: list[Entry] = field(default_factory=list)
    num_bytes: int = 0


class Handlers:
    """Dispatch table from opcode to handler, shared by every connection of a node."""

    def __init__(self, node_id: str, dram: DramTier, limits: Limits, stats: NodeStats) -> None:
        self.node_id = node_id
        self.dram = dram
        self.limits = limits
        self.stats = stats
        self.started_at = time.time()
        self._table: dict[int, Callable[[Request], Reply]] = {
            Op.HELLO: self.hello,
            Op.PUT: self.put,
            Op.GET: self.get,
            Op.EXISTS: self.exists,
            Op.DELETE: self.delete,
            Op.LOOKUP: self.lookup,
            Op.PIN: self.pin,
            Op.UNPIN: self.unpin,
            Op.STATS: self.node_stats,
        }

    def handle(self, request: Request) -> Reply:
        header = request.header
        self.stats.count(header.op, header.count)
        return self._table[header.op](request)

    # -- ops ------------------------------------------------------------------------------

    def hello(self, request: Request) -> Reply:
        body = decode_json(request.body)
        version = body.get("protocol")
        if version != PROTOCOL_VERSION:
            raise VersionMismatchError(
                f"node speaks kvpool protocol {PROTOCOL_VERSION}, client sent {version!r}")
        info = {
            "protocol": PROTOCOL_VERSION,
            "node_id": self.node_id,
            "max_value_bytes": self.limits.max_value_bytes,
            "max_batch": self.limits.max_batch,
            "max_frame_bytes": self.limits.max_frame_bytes,
        }
        return self._reply(request, [encode_json(info)])

    def put(self, request: Request) -> Reply:
        statuses = [Status.OK] * len(request.items)
        slots: list[Slot] = []
        where: list[int] = []
        ttls: list[float | None] = []
        pins: list[bool] = []
        for i, item in enumerate(request.items):
            if item.reservation is None:
                statuses[i] = Status.NO_CAPACITY
                continue
            assert isinstance(item.reservation, Slot)
            slots.append(item.reservation)
            where.append(i)
            ttls.append(item.header.ttl_ms / 1000 if item.header.ttl_ms else None)
            pins.append(bool(item.header.flags & PUT_FLAG_PIN))
            self.stats.bytes_in += item.header.value_len
        for i, ok in zip(where, self.dram.commit(slots, ttl_s=ttls, pin=pins), strict=True):
            if not ok:
                statuses[i] = Status.CORRUPT
        for status in statuses:
            if status != Status.OK:
                self.stats.error(status)
        return self._reply(request, [encode_statuses(statuses)])

    def get(self, request: Request) -> Reply:
        entries = self.dram.acquire_many(request.keys)
        dram = self.dram
        body: Buffers = []
        held: list[Entry] = []
        num_bytes = 0
        miss = GetItemHeader(Status.NOT_FOUND, 0).pack()
        for entry in entries:
            if entry is None:
                body.append(miss)
                continue
            body.append(GetItemHeader(Status.OK, entry.length).pack())
            body.append(dram.view(entry))
            held.append(entry)
            num_bytes += entry.length
        self.stats.bytes_out += num_bytes
        reply = self._reply(request, body)
        reply.held = held
        reply.num_bytes = num_bytes
        return reply

    def exists(self, request: Request) -> Reply:
        present = self.dram.contains_many(request.keys)
        return self._reply(request, [encode_statuses(
            [Status.OK if p else Status.NOT_FOUND for p in present])])

    def delete(self, request: Request) -> Reply:
        deleted = self.dram.delete_many(request.keys)
        return self._reply(request, [encode_statuses(
            [Status.OK if d else Status.NOT_FOUND for d in deleted])])

    def lookup(self, request: Request) -> Reply:
        return self._reply(request, [encode_lookup_reply(self.dram.lookup(request.keys))])

    def pin(self, request: Request) -> Reply:
        return self._pin(request, True)

    def unpin(self, request: Request) -> Reply:
        return self._pin(request, False)

    def node_stats(self, request: Request) -> Reply:
        if request.body:
            raise BadFrameError("STATS takes no body")
        return self._reply(request, [encode_json(self.snapshot())])

    # -- helpers --------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        dram = self.dram.stats()
        return {
            "node_id": self.node_id,
            "protocol": PROTOCOL_VERSION,
            "uptime_s": round(time.time() - self.started_at, 3),
            "capacity_bytes": dram.capacity_bytes,
            "used_bytes": dram.used_bytes,
            "num_objects": dram.num_objects,
            "hits": dram.hits,
            "misses": dram.misses,
            "evictions": dram.evictions,
            "tiers": {"dram": dram.to_dict()},
            **self.stats.to_dict(),
        }

    def _pin(self, request: Request, pinned: bool) -> Reply:
        done = self.dram.pin_many(request.keys, pinned)
        return self._reply(request, [encode_statuses(
            [Status.OK if d else Status.NOT_FOUND for d in done])])

    @staticmethod
    def _reply(request: Request, body: Buffers) -> Reply:
        header = request.header
        count = header.count if header.op != Op.LOOKUP else 1
        if header.op in (Op.HELLO, Op.STATS):
            count = 0
        return Reply(encode_frame(header.op, header.request_id, body, count=count))
