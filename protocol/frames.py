"""Frame layout, opcodes and the pure encoders/decoders of frame bodies.

Every frame is a 24-byte little-endian header followed by ``body_len`` bytes::

    off size field
      0    2 magic       b"KV"
      2    1 op          Op
      3    1 status      Status (always OK in requests)
      4    4 request_id  echoed in the reply; a connection is pipelined
      8    4 count       number of batch items in the body
     12    4 epoch       cluster-map epoch of the sender (0 = none yet)
     16    8 body_len

Request bodies:
    HELLO         JSON {"protocol": int, "client": str, "token"?: str}
    PUT           count x (PUT item header (32 bytes) || parent key (16 bytes, only with
                  PUT_FLAG_PARENT) || value || the value's 8-byte checksum, only with
                  PUT_FLAG_CHECKSUM_AFTER)
    GET, EXISTS, DELETE, LOOKUP, PIN, UNPIN   count x 16-byte key
    STATS, CLUSTER  empty
    GET_SHM       count x 16-byte key (only on a connection granted the shared-memory arena)
    RELEASE       count x u64 lease id
    PUT_SHM       count x (PUT item header || parent key with PUT_FLAG_PARENT), no values
                  (only on a connection granted the arena for writing)
    COMMIT        one u64 lease id (of a PUT_SHM reply); count = that reply's item count
    TOUCH         count x 16-byte key: values the client read through the arena index
                  (only on a connection granted the arena)
Reply bodies (status OK):
    HELLO, STATS  JSON object
    CLUSTER       JSON object: the node's cluster map (placement.cluster_map.ClusterMap.to_dict)
    GET           count x (GET item header (16 bytes) || value if found)
    PUT, DELETE, PIN, UNPIN  count x 1-byte Status
    EXISTS        count x 1-byte Status, then count x 1-byte Tier (0 = absent)
    LOOKUP        u32 number of leading keys present, then one Tier byte per such key
    GET_SHM       u64 lease id, then count x SHM item (32 bytes: status u8, 7 reserved,
                  offset u64, length u64, generation u64); the values stay put until the
                  lease is released or its deadline passes
    RELEASE       count x 1-byte Status (NOT_FOUND: the lease had already expired)
    PUT_SHM       u64 lease id, then count x SHM item: where the client writes each value
                  (status NO_CAPACITY where there was no room; generation 0); the slots
                  are the client's until COMMIT, or freed at the lease's deadline
    COMMIT        count x 1-byte Status, as PUT's (all NOT_FOUND: the lease had expired,
                  nothing was stored)
    TOUCH         count x 1-byte Status (NOT_FOUND: gone from DRAM meanwhile)
A request may carry W3C trace context: its op byte has OP_FLAG_TRACE (0x80) set and
its body starts with TRACE_CONTEXT_SIZE (26) bytes -- version 0 (u8), trace id (16),
parent span id (8), trace flags (u8) -- counted in ``body_len``. Clients set it only
for a sampled span, so an untraced request is byte-for-byte unchanged. Replies never
carry it.
A request's op byte may also name the scope its keys live in (key ops and PUT only):
OP_FLAG_SHARED (0x40) addresses the cluster's shared scope (readable by every tenant,
writable by admins), OP_FLAG_RAW (0x20) addresses stored keys verbatim (admins only:
node-to-node hand-off). Without either, keys are in the authenticated tenant's scope.
A reply with a status other than OK carries a UTF-8 message as its body.
Every reply carries the node's cluster-map epoch; a request whose epoch is
older than the node's, for a key the node does not accept under its map,
gets WRONG_OWNER (and nothing is done; the connection stays open).
Encoders return lists of buffers so large values are never concatenated.
"""

from __future__ import annotations

import enum
import functools
import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvpool.protocol.errors import BadFrameError, Status, WrongPortError

__all__ = [
    "CHECKSUM_TRAILER_SIZE",
    "COMMIT_AGAIN",
    "COMMIT_AS_SIZE",
    "FRAME_HEADER_SIZE",
    "FRAME_MAGIC",
    "GET_ITEM_SIZE",
    "GET_ITEM_STRUCT",
    "KEY_SIZE",
    "KEY_OPS",
    "OP_FLAG_RAW",
    "OP_FLAG_SHARED",
    "OP_FLAG_TRACE",
    "OP_SCOPE_MASK",
    "PROTOCOL_VERSION",
    "PUT_FLAG_CHECKSUM_AFTER",
    "PUT_FLAG_PARENT",
    "PUT_FLAG_PIN",
    "PUT_ITEM_SIZE",
    "SCOPE_FLAGS",
    "SCOPED_OPS",
    "SHM_ITEM_SIZE",
    "ShmItem",
    "TRACE_CONTEXT_SIZE",
    "TraceContext",
    "FrameHeader",
    "GetItemHeader",
    "Op",
    "PutItemHeader",
    "Tier",
    "bad_magic",
    "decode_commit_as",
    "decode_json",
    "decode_keys",
    "decode_lease_ids",
    "decode_shm_reply",
    "decode_lookup",
    "decode_statuses",
    "encode_commit_as",
    "encode_error",
    "encode_frame",
    "encode_json",
    "encode_keys_request",
    "encode_lease_ids",
    "encode_lookup_reply",
    "encode_statuses",
    "pack_frame_header",
    "pack_get_item",
    "pack_trace_context",
    "tier_names",
    "unpack_trace_context",
]

PROTOCOL_VERSION = 1
FRAME_MAGIC = b"KV"
KEY_SIZE = 16
PUT_FLAG_PIN = 1
#: the item header is followed by the 16-byte key of the chunk's parent (the previous chunk
#: of its prefix), which the node reports in its KV events
PUT_FLAG_PARENT = 2
#: the value's envelope carries checksum 0 and its xxh3-64 follows the value (8 bytes,
#: little-endian), which the node writes into the stored envelope; only in a PUT, only to
#: a node whose HELLO says ``checksum_after`` (envelope.ChecksumTrailer)
PUT_FLAG_CHECKSUM_AFTER = 4
CHECKSUM_TRAILER_SIZE = 8


#: set in a request's op byte: the body starts with a trace context (see the module doc)
OP_FLAG_TRACE = 0x80
#: set in a request's op byte: its keys are in the shared scope, not the tenant's
OP_FLAG_SHARED = 0x40
#: set in a request's op byte: its keys are stored keys, used verbatim (admins only)
OP_FLAG_RAW = 0x20
#: the op-byte bits that choose a scope
OP_SCOPE_MASK = OP_FLAG_SHARED | OP_FLAG_RAW
#: scope names (SDK ``scope=``, admin API ``?scope=``) -> op-byte bits
SCOPE_FLAGS = {"tenant": 0, "shared": OP_FLAG_SHARED, "raw": OP_FLAG_RAW}


class Op(enum.IntEnum):
    HELLO = 1
    PUT = 2
    GET = 3
    EXISTS = 4
    DELETE = 5
    LOOKUP = 6
    PIN = 7
    UNPIN = 8
    STATS = 9
    CLUSTER = 10
    #: GET over shared memory: where each value lies in the node's arena, under a lease
    GET_SHM = 11
    #: end leases of GET_SHM replies (the client has copied the values)
    RELEASE = 12
    #: PUT over shared memory: reserve arena slots the client writes into, under a lease
    PUT_SHM = 13
    #: publish the slots of a PUT_SHM lease (the client has written the values)
    COMMIT = 14
    #: reads made through the arena index, with no request: count them, refresh recency
    TOUCH = 15
    #: publish the slots of a PUT_SHM lease under the item headers this frame carries (the
    #: keys of the values written into them), and with COMMIT_AGAIN reserve as many slots
    #: of the same sizes under a new lease: a same-host put in one round trip
    COMMIT_AS = 16


#: Ops whose request body is exactly ``count`` keys.
KEY_OPS = frozenset({Op.GET, Op.EXISTS, Op.DELETE, Op.LOOKUP, Op.PIN, Op.UNPIN, Op.GET_SHM,
                     Op.TOUCH})
#: Ops whose op byte may carry scope bits (OP_FLAG_SHARED, OP_FLAG_RAW).
SCOPED_OPS = KEY_OPS | {Op.PUT, Op.PUT_SHM, Op.COMMIT_AS}

_FRAME = struct.Struct("<2sBBIIIQ")
FRAME_HEADER_SIZE = _FRAME.size
assert FRAME_HEADER_SIZE == 24


@dataclass(slots=True)
class FrameHeader:
    """The 24-byte frame header.

    Wire headers are NamedTuples or plain slotted dataclasses, never frozen
    dataclasses: a frozen dataclass's ``__init__`` costs ~1 us here and runs
    several times per request. (This one is not a NamedTuple: ``count`` would
    shadow ``tuple.count``.)
    """

    op: int
    request_id: int
    count: int
    body_len: int
    status: int = Status.OK
    epoch: int = 0

    def pack(self) -> bytes:
        return _FRAME.pack(FRAME_MAGIC, self.op, self.status, self.request_id, self.count,
                           self.epoch, self.body_len)


    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> FrameHeader:
        magic, op, status, request_id, count, epoch, body_len = _FRAME.unpack(buf)
        if magic != FRAME_MAGIC:
            raise bad_magic(bytes(buf[:4]))
        return cls(op, request_id, count, body_len, status, epoch)


#: how HTTP messages start (their first four bytes): a reply, and requests by method
_HTTP_REPLY = b"HTTP"
_HTTP_REQUESTS = (b"GET ", b"POST", b"PUT ", b"HEAD", b"DELE", b"OPTI", b"PATC")


def bad_magic(start: bytes) -> BadFrameError:
    """The error for a frame that does not start with kvpool's magic; HTTP gets words
    naming the port mix-up (a data client at an admin port, or an HTTP client at a data
    port)."""
    if start == _HTTP_REPLY:
        return WrongPortError("the node answered in HTTP: this is an admin port, not a data "
                              "port (a node's data port is by default its admin port - 1, "
                              "7700)")
    if start in _HTTP_REQUESTS:
        return WrongPortError("an HTTP request on a kvpool data port: the admin HTTP API is "
                              "on the node's admin port (by default the data port + 1, 7701)")
    return BadFrameError(f"bad frame magic {start[:2]!r}")


_PUT_ITEM = struct.Struct("<16sQII")
PUT_ITEM_SIZE = _PUT_ITEM.size
assert PUT_ITEM_SIZE == 32


class PutItemHeader(NamedTuple):
    """``key, value_len, ttl_ms (0 = node default), flags (PUT_FLAG_PIN, PUT_FLAG_PARENT)``."""

    key: bytes
    value_len: int
    ttl_ms: int = 0
    flags: int = 0

    def pack(self) -> bytes:
        return _PUT_ITEM.pack(self.key, self.value_len, self.ttl_ms, self.flags)

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> PutItemHeader:
        key, value_len, ttl_ms, flags = _PUT_ITEM.unpack(buf)
        return cls(bytes(key), value_len, ttl_ms, flags)


_GET_ITEM = struct.Struct("<B7xQ")
#: a GET item header's layout (status, value_len), for parsers that read it in place
GET_ITEM_STRUCT = _GET_ITEM
GET_ITEM_SIZE = _GET_ITEM.size
assert GET_ITEM_SIZE == 16


class GetItemHeader(NamedTuple):
    """``status, value_len``; the value follows when status is OK."""

    status: int
    value_len: int

    def pack(self) -> bytes:
        return _GET_ITEM.pack(self.status, self.value_len)

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> GetItemHeader:
        status, value_len = _GET_ITEM.unpack(buf)
        return cls(status, value_len)


_U32 = struct.Struct("<I")

_SHM_ITEM = struct.Struct("<B7xQQQ")
SHM_ITEM_SIZE = _SHM_ITEM.size
assert SHM_ITEM_SIZE == 32
_U64 = struct.Struct("<Q")


class ShmItem(NamedTuple):
    """Where a GET_SHM value lies (or a PUT_SHM value goes): ``status, offset, length,
    generation`` (see the arena; 0 for PUT_SHM)."""

    status: int
    offset: int
    length: int
    generation: int

    def pack(self) -> bytes:
        return _SHM_ITEM.pack(self.status, self.offset, self.length, self.generation)


def decode_shm_reply(body: bytes | bytearray | memoryview, count: int
                     ) -> tuple[int, list[ShmItem]]:
    """``(lease id, items)`` of a GET_SHM or PUT_SHM reply."""
    if len(body) != 8 + SHM_ITEM_SIZE * count:
        raise BadFrameError(f"shared-memory reply of {len(body)} bytes for {count} items")
    (lease,) = _U64.unpack_from(body)
    return lease, [ShmItem(*_SHM_ITEM.unpack_from(body, 8 + i * SHM_ITEM_SIZE))
                   for i in range(count)]


def encode_lease_ids(ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(ids)}Q", *ids)


def decode_lease_ids(body: bytes | bytearray | memoryview, count: int) -> list[int]:
    if len(body) != 8 * count:
        raise BadFrameError(f"{count} lease ids need {8 * count} body bytes, got {len(body)}")
    return list(struct.unpack(f"<{count}Q", body))


#: COMMIT_AS's fixed part: the lease id, flags (COMMIT_AGAIN), zero
_COMMIT_AS = struct.Struct("<QII")
COMMIT_AS_SIZE = _COMMIT_AS.size
assert COMMIT_AS_SIZE == 16
#: COMMIT_AS flag: reserve the same number of slots of the same sizes under a new lease
COMMIT_AGAIN = 1


def encode_commit_as(lease: int, flags: int) -> bytes:
    """What a COMMIT_AS body starts with (its item headers follow, as in PUT_SHM)."""
    return _COMMIT_AS.pack(lease, flags, 0)


def decode_commit_as(prefix: bytes | bytearray | memoryview) -> tuple[int, int]:
    """``(lease id, flags)`` of a COMMIT_AS body's fixed part."""
    lease, flags, zero = _COMMIT_AS.unpack(prefix)
    if zero or flags & ~COMMIT_AGAIN:
        raise BadFrameError(f"COMMIT_AS with unknown flags {flags:#x}/{zero:#x}")
    return lease, flags


_TRACE = struct.Struct("<B16s8sB")
TRACE_CONTEXT_SIZE = _TRACE.size
assert TRACE_CONTEXT_SIZE == 26


class TraceContext(NamedTuple):
    """W3C trace context (``traceparent``'s fields) as carried in a request frame."""

    trace_id: int
    span_id: int
    trace_flags: int


def pack_trace_context(trace_id: int, span_id: int, trace_flags: int) -> bytes:
    return _TRACE.pack(0, trace_id.to_bytes(16, "big"), span_id.to_bytes(8, "big"),
                       trace_flags & 0xFF)


def unpack_trace_context(buf: bytes | bytearray | memoryview) -> TraceContext:
    """The context, or BadFrameError for an unknown version or an all-zero id."""
    version, trace_id, span_id, flags = _TRACE.unpack(buf)
    if version != 0:
        raise BadFrameError(f"unknown trace context version {version}")
    tid, sid = int.from_bytes(trace_id, "big"), int.from_bytes(span_id, "big")
    if not tid or not sid:
        raise BadFrameError("trace context with an all-zero trace or span id")
    return TraceContext(tid, sid, flags)


def pack_frame_header(op: int, request_id: int, count: int, body_len: int, *,
                      status: int = 0, epoch: int = 0) -> bytes:
    return _FRAME.pack(FRAME_MAGIC, op, status, request_id, count, epoch, body_len)


def pack_get_item(status: int, value_len: int) -> bytes:
    return _GET_ITEM.pack(status, value_len)


def encode_frame(
    op: int,
    request_id: int,
    body: Sequence[bytes | bytearray | memoryview] = (),
    *,
    count: int = 0,
    status: int = Status.OK,
    epoch: int = 0,
) -> list[bytes | bytearray | memoryview]:
    """Header followed by the body buffers, as a list for ``writelines``."""
    body_len = sum(len(b) if type(b) is bytes else memoryview(b).nbytes for b in body)
    return [pack_frame_header(op, request_id, count, body_len, status=status, epoch=epoch),
            *body]


def encode_keys_request(op: int, request_id: int, keys: Sequence[bytes]) -> list[bytes]:
    body = b"".join(keys)
    if len(body) != KEY_SIZE * len(keys):
        raise BadFrameError("every key must be 16 bytes")
    return [pack_frame_header(op, request_id, len(keys), len(body)), body]


def decode_keys(body: bytes | bytearray | memoryview, count: int) -> Sequence[bytes]:
    """The ``count`` 16-byte keys of a key op's body, split in C (a struct of ``count``
    16-byte fields: 512 keys in ~14 us here, against ~46 us for a comprehension)."""
    if len(body) != KEY_SIZE * count:
        raise BadFrameError(f"{count} keys need {KEY_SIZE * count} body bytes, got {len(body)}")
    return _keys_struct(count).unpack(body)


# (at most 64 structs of at most ``max_batch`` fields: ~140 KB each at 4096 keys; a new
# one is made in ~75 us at that size, still less than the comprehension took)
@functools.lru_cache(maxsize=64)
def _keys_struct(count: int) -> struct.Struct:
    return struct.Struct(f"{KEY_SIZE}s" * count)


def encode_statuses(statuses: Sequence[int]) -> bytes:
    return bytes(statuses)


def decode_statuses(body: bytes | bytearray | memoryview, count: int) -> list[int]:
    if len(body) != count:
        raise BadFrameError(f"expected {count} item statuses, got {len(body)} bytes")
    return list(bytes(body))


class Tier(enum.IntEnum):
    """Where a node holds a chunk, as LOOKUP reports it."""

    DRAM = 1
    SSD = 2
    S3 = 3


#: a tier's name by its code: None for 0 (no tier holds the key), "?" for a code this
#: version does not know
_TIER_NAME_BY_CODE: tuple[str | None, ...] = tuple(
    None if code == 0 else Tier(code).name.lower() if code in Tier._value2member_map_ else "?"
    for code in range(256))


def tier_names(codes: Iterable[int]) -> list[str | None]:
    """Tier codes (EXISTS, LOOKUP) as names: "dram", "ssd", "s3"; None where absent.

    One C-level pass (512 codes in ~10 us; a comprehension with a dict took ~100)."""
    return list(map(_TIER_NAME_BY_CODE.__getitem__, codes))


def encode_lookup_reply(tiers: Sequence[int]) -> bytes:
    """The number of leading keys present, then the tier of each of them."""
    return _U32.pack(len(tiers)) + bytes(tiers)


def decode_lookup(body: bytes | bytearray | memoryview) -> list[int]:
    """The tier of each leading key present (its length is the number present)."""
    if len(body) < _U32.size:
        raise BadFrameError(f"LOOKUP reply must be at least 4 bytes, got {len(body)}")
    (n,) = _U32.unpack_from(body)
    if len(body) != _U32.size + n:
        raise BadFrameError(f"LOOKUP reply for {n} keys must be {4 + n} bytes, got {len(body)}")
    return list(bytes(body[_U32.size :]))


def encode_json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def decode_json(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        obj = json.loads(bytes(body))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadFrameError(f"body is not JSON: {exc}") from exc
    except RecursionError:  # (json's C scanner stops a deep nesting cleanly)
        raise BadFrameError("JSON body nested too deep") from None
    if not isinstance(obj, dict):
        raise BadFrameError("JSON body must be an object")
    return obj


def encode_error(op: int, request_id: int, status: int, message: str, *,
                 epoch: int = 0) -> list[bytes]:
    body = message.encode("utf-8", "replace")[:4096]
    return [pack_frame_header(op, request_id, 0, len(body), status=status, epoch=epoch), body]
