"""Layout of the arena index: where each DRAM value lies, in shared memory.

The node publishes, for each value in its DRAM arena, one 64-byte slot in a
memory file it shares (read-only) with granted same-host clients, next to
the arena itself. A client looks a key up there and copies the value with
no request at all (the zero-round-trip GET of the fast path); a key it does
not find, or finds stale, it asks for with GET_SHM as before.

File layout (little-endian)::

    off  size
      0    64  header: magic b"KVIDX\\x00\\x00\\x01", u64 number of sets, u64 ways per set,
               u64 the node's cluster-map epoch (0: standalone), zeros
     64   ...  sets x ways x slot

    slot (64 bytes): key (16) | offset u64 | length u64 | generation u64 |
                     checksum u64 | expires f64 | check u64

``offset``, ``length`` and ``generation`` are what a GET_SHM reply says for
the value (envelope included); ``checksum`` is its envelope's payload
checksum (the node publishes raw values only, never compressed ones); ``expires`` the
wall-clock time (``time.time()``) its TTL ends (0: none); ``check`` is the
xxh3-64 of the 56 bytes before it. A key lives in set ``xxh3_64(key) %
sets``, in any of its ways; an empty way is all zeros (which fails the
check). The node is the only writer and rewrites a slot with one 64-byte
copy; a reader that catches it mid-write sees a failed check and asks the
node instead.

Nothing in a slot is trusted on its own: the client copies the payload,
re-reads the extent's generation (a value freed meanwhile is retried with
GET_SHM) and accepts the copy only if the payload hashes to the slot's checksum
(hashed where it lies or as copied: docs/protocol.md, "Hash, then copy") -- so
a slot seen out of order with the arena's memory can cost a round trip, never
a wrong value.

A client reads the index only while its cluster-map epoch is the one in the
header: a node that no longer owns a key still holds it for a while, and a
client on an old map must hear WRONG_OWNER from a GET_SHM, not read it there.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

__all__ = ["EPOCH_AT", "HEADER", "HEADER_SIZE", "INDEX_MAGIC", "SLOT", "SLOT_SIZE", "WAYS",
           "IndexSlot", "index_sets", "pack_slot", "set_of", "unpack_slot"]

INDEX_MAGIC = b"KVIDX\x00\x00\x01"
HEADER = struct.Struct("<8sQQ")
#: where the header's u64 epoch lies
EPOCH_AT = HEADER.size
HEADER_SIZE = 64
SLOT = struct.Struct("<16sQQQQdQ")
SLOT_SIZE = SLOT.size
assert SLOT_SIZE == 64
_BODY = SLOT_SIZE - 8
#: ways per set: a key is found by one scan of 512 bytes
WAYS = 8
#: one slot per this many arena bytes (values are KV chunks, 256 KiB and up; a node with
#: more, smaller values serves the ones that found no free way with GET_SHM)
BYTES_PER_SLOT = 32 << 10
MIN_SETS = 64


class IndexSlot(NamedTuple):
    key: bytes
    offset: int
    length: int
    generation: int
    checksum: int
    expires: float


def index_sets(arena_capacity: int) -> int:
    """Sets for an arena of this many bytes: a power of two, >= MIN_SETS."""
    want = max(MIN_SETS, arena_capacity // BYTES_PER_SLOT // WAYS)
    return 1 << (want - 1).bit_length()


def set_of(key: bytes, sets: int) -> int:
    return xxhash.xxh3_64_intdigest(key) & (sets - 1)


def pack_slot(slot: IndexSlot) -> bytes:
    body = SLOT.pack(*slot, 0)[:_BODY]
    return body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")


def unpack_slot(raw: bytes | memoryview) -> IndexSlot | None:
    """The slot in ``raw`` (SLOT_SIZE bytes), or None: empty, or caught mid-write."""
    body = raw[:_BODY]
    if xxhash.xxh3_64_intdigest(body) != int.from_bytes(raw[_BODY:SLOT_SIZE], "little"):
        return None
    return IndexSlot(*SLOT.unpack(raw)[:6])
