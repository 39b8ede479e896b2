"""The per-node half of each TCP op as a plan: requests out, replies in, no I/O.

A plan is a generator. It yields the request frames it needs next (one
:data:`Call` per frame, all sent at once, their replies sent back in the
same order) and returns the op's raw per-key outcome. Two drivers run the
same plans: :meth:`kvpool.client._node.NodeClient.run` over the pipelined
asyncio connections, and :class:`kvpool.client._blocking.BlockingNode` over
one blocking socket for the sync client (no event loop per call). Replies
whose status is not OK never reach a plan: the driver raises their error.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from kvpool.client._checks import checked_hello, reply_json, reply_statuses
from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE, ChecksumTrailer, seal
from kvpool.protocol.errors import (
    BadReplyError,
    BufferTooSmallError,
    InvalidArgumentError,
    Status,
    ValueTooLargeError,
)
from kvpool.protocol.frames import (
    KEY_SIZE,
    PROTOCOL_VERSION,
    PUT_FLAG_CHECKSUM_AFTER,
    PUT_FLAG_PARENT,
    Op,
    PutItemHeader,
    decode_lookup,
    encode_json,
)
from kvpool.protocol.host import host_id
from kvpool.protocol.parsers import TOO_SMALL, Reply, Segments

__all__ = ["Call", "Plan", "PutItem", "arena_offer", "as_segments", "blob_part", "chunks",
           "drop_corrupt", "exists", "flat_view", "frames", "get_tcp", "hello", "json_op",
           "lookup", "put_items", "put_tcp", "routed_by", "rows_blob", "statuses",
           "too_small"]

log = logging.getLogger("kvpool.client")
#: the epoch of the cluster map the current call was routed by (0: the node's own
#: ``epoch``). A frame must carry that epoch, not whatever map is installed by the time
#: it is encoded: a node trusts a frame of its own epoch without checking ownership, so
#: a frame routed by an old map but stamped with the new epoch would be stored on a node
#: that no longer owns the key, where no reader looks for it.
routed_by: contextvars.ContextVar[int] = contextvars.ContextVar("kvpool_routed_by", default=0)
T = TypeVar("T")
Buffer = bytes | bytearray | memoryview
#: a buffer, or a list of buffers used in order as one (like readv/writev)
BufferOrSegments = Buffer | list[Buffer] | tuple[Buffer, ...]
Sink = memoryview | Segments
#: one request frame: op, item count, body parts, and the GET reply's sinks (or None)
Call = tuple[int, int, Sequence[Buffer], Sequence[Sink | None] | None]
Plan = Generator[list[Call], list[Reply], T]
_OK = Status.OK  # (a module global: an enum attribute lookup costs ~0.2 us a time)


class Host(Protocol):
    """What a plan reads and counts of the node it talks to (a ``NodeClient``)."""

    node_id: str
    server_info: dict[str, Any]
    bytes_by_path: dict[str, int]
    put_bytes_by_path: dict[str, int]
    num_corrupt: int


# -- batches ------------------------------------------------------------------------------

def chunks(n: int, size: int) -> list[range]:
    """Batch positions ``0..n`` in runs of at most ``size`` (one frame each)."""
    if n <= size:  # the common case, without a generator (every sync call pays for one)
        return [range(n)] if n else []
    return [range(start, min(n, start + size)) for start in range(0, n, size)]


def blob_part(blob: bytes, part: range) -> bytes:
    return blob[part.start * KEY_SIZE : part.stop * KEY_SIZE]


def rows_blob(blob: bytes, rows: Sequence[int] | npt.NDArray[np.intp]) -> bytes:
    """The keys at ``rows`` (increasing batch positions, as picks give them)."""
    if len(rows) * KEY_SIZE == len(blob) and (len(rows) < 2 or rows[-1] == len(rows) - 1):
        return blob
    keys = np.frombuffer(blob, dtype="V16")
    return keys[np.asarray(rows, dtype=np.intp)].tobytes()


def flat_view(buffer: Buffer) -> memoryview:
    """``buffer`` as a flat byte view (InvalidArgumentError if it is not contiguous)."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise InvalidArgumentError(
            f"buffers must be C-contiguous; got a {view.ndim}-d view with strides "
            f"{view.strides} (copy it, or pass a list of contiguous pieces)")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def as_segments(value: BufferOrSegments) -> list[memoryview]:
    """A value as flat byte views: one for a buffer, one per buffer for a list or tuple."""
    parts = value if isinstance(value, (list, tuple)) else (value,)
    return [flat_view(part) for part in parts] or [memoryview(b"")]


def _max_batch(node: Host) -> int:
    return int(node.server_info["max_batch"])


# -- key ops ------------------------------------------------------------------------------

def get_tcp(node: Host, blob: bytes, sinks: Sequence[Sink] | None) -> Plan[list[Sink | None]]:
    """GET: payload views, None for misses and corrupt chunks (deleted on the node)."""
    parts = chunks(len(blob) // KEY_SIZE, _max_batch(node))
    replies = yield [(Op.GET, len(p), [blob_part(blob, p)],
                      [sinks[i] for i in p] if sinks is not None else None) for p in parts]
    out, corrupt = received(node, blob, sinks, parts, replies)
    if corrupt:
        yield from drop_corrupt(node, corrupt)
    return out


def received(node: Host, blob: bytes, sinks: Sequence[Sink] | None, parts: Sequence[range],
             replies: Sequence[Reply]) -> tuple[list[Sink | None], list[bytes]]:
    """GET replies (one per part of the batch) as payload views, None for misses and
    corrupt chunks, and the corrupt chunks' keys (to drop)."""
    out: list[Sink | None] = []
    corrupt: list[bytes] = []
    for part, reply in zip(parts, replies, strict=True):
        for i, item in zip(part, reply.items, strict=True):
            if item.status == _OK:
                assert item.payload is not None
                out.append(item.payload)
                node.bytes_by_path["tcp"] += len(item.payload)
                continue
            if item.status == TOO_SMALL:
                too_small(blob, i, sinks)
            if item.status == Status.CORRUPT:
                corrupt.append(blob_part(blob, range(i, i + 1)))
            out.append(None)
    return out, corrupt


def too_small(blob: bytes, i: int, sinks: Sequence[Sink] | None) -> Any:
    """Raise BufferTooSmallError for the ``i``-th key (typed ``Any``: it never returns)."""
    sink = sinks[i] if sinks else None
    size = sink.nbytes if sink is not None else 0
    raise BufferTooSmallError(
        f"buffer of {size} bytes is too small for the payload of "
        f"{blob_part(blob, range(i, i + 1)).hex()}")


def drop_corrupt(node: Host, corrupt: list[bytes]) -> Plan[None]:
    """Count corrupt chunks and delete them, so the next writer replaces them."""
    if corrupt:
        node.num_corrupt += len(corrupt)
        log.warning(
            "dropping %d corrupt chunk(s) on %s (treated as misses): %s", len(corrupt),
            node.node_id, ", ".join(k.hex() for k in corrupt[:4]))
        yield from statuses(node, Op.DELETE, b"".join(corrupt))


def exists(node: Host, blob: bytes) -> Plan[bytes]:
    """One tier code per key, 0 where absent (the EXISTS reply's second half)."""
    parts = chunks(len(blob) // KEY_SIZE, _max_batch(node))
    replies = yield [(Op.EXISTS, len(p), [blob_part(blob, p)], None) for p in parts]
    codes = bytearray()
    for part, reply in zip(parts, replies, strict=True):
        body = reply.body  # count statuses, then count tier codes
        if len(body) != 2 * len(part):
            raise BadReplyError(node.node_id, f"an EXISTS reply of {len(body)} bytes for "
                                f"{len(part)} keys")
        codes += body[len(part) :]
    return bytes(codes)


def lookup(node: Host, blob: bytes) -> Plan[list[int]]:
    """Tier codes of the leading keys the node holds (LOOKUP stops at the first miss)."""
    tiers: list[int] = []
    for part in chunks(len(blob) // KEY_SIZE, _max_batch(node)):
        (reply,) = yield [(Op.LOOKUP, len(part), [blob_part(blob, part)], None)]
        found = decode_lookup(reply.body)
        if len(found) > len(part) or 0 in found:
            raise BadReplyError(node.node_id, f"a LOOKUP of {len(part)} keys answered "
                                f"{len(found)} found, tier codes {bytes(found[:8]).hex()}")
        tiers += found
        if len(found) < len(part):
            break
    return tiers


def statuses(node: Host, op: Op, blob: bytes) -> Plan[list[int]]:
    """DELETE, PIN, UNPIN (and the like): one Status per key."""
    parts = chunks(len(blob) // KEY_SIZE, _max_batch(node))
    replies = yield [(op, len(p), [blob_part(blob, p)], None) for p in parts]
    out: list[int] = []
    for part, reply in zip(parts, replies, strict=True):
        out += reply_statuses(node.node_id, reply.body, len(part))
    return out


def hello(node: Host, client_name: str, token: str | None, *, arena: bool
          ) -> Plan[dict[str, Any]]:
    """HELLO, the first frame of every connection: the node's limits and offers, checked.
    ``arena``: ask for its shared-memory arena (a client that may be on its host)."""
    request: dict[str, Any] = {"protocol": PROTOCOL_VERSION, "client": client_name}
    if token:
        request["token"] = token
    if arena:
        request.update(shm=True, host=host_id())
    (reply,) = yield [(Op.HELLO, 0, [encode_json(request)], None)]
    return checked_hello(node.node_id, reply_json(node.node_id, reply.body))


def arena_offer(info: dict[str, Any]) -> dict[str, Any] | None:
    """The arena a HELLO reply offers to redeem (None: none offered, or refused)."""
    offer = info.get("shm")
    return offer if isinstance(offer, dict) and "refused" not in offer else None


def json_op(node: Host, op: Op) -> Plan[dict[str, Any]]:
    """STATS or CLUSTER: an empty request, a JSON reply."""
    (reply,) = yield [(op, 0, [], None)]
    return reply_json(node.node_id, reply.body)


# -- PUT ----------------------------------------------------------------------------------

@dataclass(slots=True)
class PutItem:
    """One value of a ``put``: where it goes in the reply, its item header and parts."""

    index: int
    header: PutItemHeader
    parent: bytes | None
    parts: list[memoryview]
    nbytes: int
    chunk_index: int

    def head(self, flags: int = 0) -> list[Buffer]:
        """What precedes the value in a PUT frame (all there is of it in PUT_SHM), with
        ``flags`` added to the item header's."""
        header = (self.header._replace(flags=self.header.flags | flags) if flags
                  else self.header).pack()
        return [header, self.parent] if self.parent else [header]


def put_items(node: Host, bkeys: Sequence[bytes], values: Sequence[BufferOrSegments], *,
              ttl_ms: int, flags: int, chunk_indexes: Sequence[int] | None,
              parents: Sequence[bytes | None] | None) -> list[PutItem]:
    """The values of a put as items; ValueTooLargeError for one over the node's limit."""
    max_value = int(node.server_info["max_value_bytes"])
    items: list[PutItem] = []
    for i, (key, value) in enumerate(zip(bkeys, values, strict=True)):
        parts = as_segments(value)
        nbytes = sum(p.nbytes for p in parts)
        if ENVELOPE_HEADER_SIZE + nbytes > max_value:
            raise ValueTooLargeError(
                f"value of {nbytes} bytes (+{ENVELOPE_HEADER_SIZE} envelope) exceeds "
                f"the node's max_value_bytes {max_value}")
        parent = parents[i] if parents is not None else None
        header = PutItemHeader(key, ENVELOPE_HEADER_SIZE + nbytes, ttl_ms,
                               flags | PUT_FLAG_PARENT if parent else flags)
        items.append(PutItem(i, header, parent, parts, nbytes,
                             chunk_indexes[i] if chunk_indexes else 0))
    return items


def frames(node: Host, items: list[PutItem]) -> list[list[PutItem]]:
    """``items`` split into frames within the node's max_batch and max_frame_bytes."""
    max_frame = int(node.server_info["max_frame_bytes"])
    max_batch = _max_batch(node)
    out: list[list[PutItem]] = []
    frame: list[PutItem] = []
    frame_bytes = 0
    for item in items:
        # a PUT_SHM frame carries no values, but reserves no more than a PUT would carry
        item_bytes = 32 + item.header.value_len + (KEY_SIZE if item.parent else 0)
        if frame and (len(frame) == max_batch or frame_bytes + item_bytes > max_frame):
            out.append(frame)
            frame, frame_bytes = [], 0
        frame.append(item)
        frame_bytes += item_bytes
    if frame:
        out.append(frame)
    return out


#: values of this many bytes and more send their checksum after them, hashed while the
#: node reads them (1 and 4 MiB PUTs, one and 16 a call: 1.00-1.24x the GB/s of hashing
#: first in two `bench.peers --ab` runs on the 2-core VM); a smaller value is hashed first,
#: where a trailer's extra steps cost more than they save
TRAILER_MIN = 64 << 10


def put_tcp(node: Host, items: list[PutItem], out: list[int], *, num_tokens: int,
            fingerprint: bytes) -> Plan[list[int]]:
    """PUT: each item's Status into ``out`` at its index; returns ``out``."""
    batches = frames(node, items)
    # a node that takes the checksum after the value: the sender hashes each large value
    # once it is on its way, while the node still reads it (envelope.ChecksumTrailer)
    after = TRAILER_MIN if node.server_info.get("checksum_after") else None
    calls: list[Call] = []
    for frame in batches:
        body: list[Buffer] = []
        for item in frame:
            parts = item.parts
            payload = list[Buffer](parts) if len(parts) > 1 else parts[0]
            trailer = after is not None and item.nbytes >= after
            envelope = seal(payload, chunk_index=item.chunk_index, num_tokens=num_tokens,
                            fingerprint=fingerprint, deferred=trailer)
            if trailer:
                body += [*item.head(PUT_FLAG_CHECKSUM_AFTER), envelope, *parts,
                         ChecksumTrailer(payload)]
            else:
                body += [*item.head(), envelope, *parts]
        calls.append((Op.PUT, len(frame), body, None))
    replies = yield calls
    for frame, reply in zip(batches, replies, strict=True):
        for item, status in zip(frame, reply_statuses(node.node_id, reply.body, len(frame)),
                                strict=True):
            out[item.index] = status
            if status == Status.OK:
                node.put_bytes_by_path["tcp"] += item.nbytes
    return out
