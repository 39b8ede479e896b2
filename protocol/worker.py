"""The cold-tier worker's protocol: the messages between a node and its SSD worker.

The worker (``server/cold/ssd_worker.py``) is a child process that owns RocksDB and S3;
it maps the node's DRAM arena and moves chunk bytes in place, so only small
fixed-size messages cross the socketpair between them:

    request  (40 bytes)  op u8 | 3 pad | request_id u32 | key 16 | offset u64 | length u64
    reply    (16 bytes)  request_id u32 | status u8 | 3 pad | length u64, then ``length``
                         payload bytes for KEYS (n x (key 16 | value_len u64)),
                         STATS (JSON), PUT (n x 16-byte keys it evicted), FETCH
                         (value_len u64) and S3_KEYS (n x (key 16 | S3Change u8)))

Before the first request the node hands the worker its :class:`WorkerSettings` (the
SSD tier's and the S3 tier's settings, as JSON on the worker's stdin); the command line
carries only the process's plumbing (the RocksDB directory, inherited descriptors, the
parent's pid).

Pure: no I/O (the node's handle on the worker, ``server/cold/ssd.py``, and the worker
itself do theirs).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from typing import Any

from kvpool.protocol.envelope import Codec
from kvpool.protocol.errors import ConfigError

__all__ = ["KEY_LEN", "REPLY", "REQUEST", "S3_CHANGE", "S3_LOG_PAGE", "S3Change", "S3Settings",
           "SsdOp", "SsdStatus", "TieringPolicy", "WorkerSettings", "decode_keys"]


@dataclass(frozen=True, slots=True)
class S3Settings:
    """The S3 tier (below the SSD, or alone below DRAM): where it is, and how the worker
    writes behind to it (everything the SSD takes is uploaded, within
    ``max_pending_bytes`` in flight; with no SSD, each write is an upload answered once
    S3 has it)."""

    bucket: str
    prefix: str = "kvpool"
    endpoint_url: str = ""  #: "" = AWS
    region: str = ""  #: "" = from the AWS config chain
    codec: Codec = Codec.RAW
    #: upload bytes in flight; past it, write-behind to S3 is shed (and counted)
    max_pending_bytes: int = 256 << 20
    #: seconds between LISTs that find other nodes' chunks and drop deleted ones
    relist_interval_s: float = 60.0


@dataclass(frozen=True, slots=True)
class TieringPolicy:
    """Where a node's chunks go below DRAM: decided once from its config
    (``server.resources.tiering_policy``), held by its ``TierManager`` and sent to its
    cold-tier worker in :class:`WorkerSettings`.

    Rules that are not settings: a chunk with a TTL lives in DRAM only (a copy of its
    key below is deleted), and a chunk whose key a tier below holds already is not
    written there again (a key is its content's address).
    """

    #: write chunks behind to the SSD tier (RocksDB on local disk)
    ssd: bool = True
    #: write them behind to S3: after the SSD, or right below DRAM without one (every
    #: write then an upload the worker answers once S3 has it)
    s3: bool = False
    #: answer a PUT only once S3 holds each chunk (with ``s3``)
    write_through: bool = False
    #: which chunks go below DRAM: "all" (each written behind at its PUT), or "reused"
    #: (written behind once it shows reuse: read or looked up while in DRAM, or stored
    #: again after DRAM evicted it; write-through chunks and pinned ones at their PUT)
    admit: str = "all"

    @property
    def cold(self) -> bool:
        """Whether anything is below DRAM (else the node runs no worker)."""
        return self.ssd or self.s3


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What the cold-tier worker runs, decided once by the node (``server/node.py``)."""

    capacity_bytes: int
    codec: Codec = Codec.LZ4
    #: the node's tiering policy (without ``ssd`` the worker opens no RocksDB and serves
    #: S3 alone)
    policy: TieringPolicy = TieringPolicy()
    #: RocksDB memtable bytes (None: an eighth of the capacity, 2-64 MiB)
    write_buffer_bytes: int | None = None
    #: the worker's niceness: on a busy machine the node's event loop should win the CPU
    nice: int = 5
    #: make the worker non-dumpable (the node serves tenants: it maps their bytes)
    no_dumps: bool = False
    s3: S3Settings | None = None

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> WorkerSettings:
        """ConfigError for anything but what :meth:`encode` makes."""
        try:
            fields: dict[str, Any] = json.loads(data)
            s3 = fields.pop("s3")
            return cls(**{**fields, "codec": Codec(fields["codec"]),
                          "policy": TieringPolicy(**fields["policy"])},
                       s3=S3Settings(**{**s3, "codec": Codec(s3["codec"])}) if s3 else None)
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"bad cold-tier worker settings: {exc}") from exc

REQUEST = struct.Struct("<B3xI16sQQ")
REPLY = struct.Struct("<IB3xQ")
KEY_LEN = struct.Struct("<16sQ")
#: one record of the worker's S3 log: key, S3Change
S3_CHANGE = struct.Struct("<16sB")
#: most S3 log records one S3_KEYS reply carries (a shorter reply: the log's end)
S3_LOG_PAGE = 65536


class SsdOp:
    PUT = 1  # write arena[offset:offset+length] (a RAW envelope) under key
    GET = 2  # read key into arena[offset:offset+length]; length must be its value_len
    DELETE = 3
    KEYS = 4  # every key and its value_len: the node's index at start-up
    STATS = 5
    FETCH = 6  # fetch key from S3 into the worker; reply length = its value_len
    COPY = 7  # copy a fetched value into arena[offset:offset+length]
    S3_KEYS = 8  # changes to what S3 holds, from record ``offset`` of the worker's log
    PUT_DURABLE = 9  # as PUT, then upload to S3 and reply only once S3 has it
    EVICT = 10  # drop key from the SSD only (S3 keeps its copy): a tenant's SSD quota
    CONFIRM = 11  # ask S3 itself (a HEAD) whether it has key: OK, or MISS
    REOPEN = 12  # after a full disk: try to take writes again: OK, or FULL and why not


class S3Change:
    """What one S3-log record says of its key, in the order the worker learned it."""

    GONE = 0  # S3 no longer has it: a 404, a corrupt object, a capacity victim, a LIST
    PRESENT = 1  # S3 has it: uploaded, fetched, or found by a LIST
    DELETED = 2  # the node's DELETE of it has run (one record per DELETE the node sent)


class SsdStatus:
    OK = 0
    MISS = 1
    REFUSED = 2  # not an envelope, or larger than the tier
    CORRUPT = 3  # failed its checksum on disk: dropped
    SIZE = 4  # the slot does not match the stored value's length
    ERROR = 5
    FULL = 6  # the disk filled up: the tier serves reads and refuses writes


def decode_keys(payload: bytes) -> dict[bytes, int]:
    return {key: n for key, n in KEY_LEN.iter_unpack(payload)}
