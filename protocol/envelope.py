"""The chunk envelope: every stored value is ``header || payload``.

The 64-byte little-endian header (see docs/protocol.md)::

    off size field
      0    4 magic        b"KVPC"
      4    1 version      1
      5    1 codec        Codec (0 raw, 1 lz4, 2 shuffle+lz4)
      6    1 elem_size    element size for the shuffle codec (0 otherwise)
      7    1 flags        reserved, 0
      8    8 raw_len      payload length before the codec
     16    8 stored_len   payload length as stored (after the codec)
     24    8 checksum     xxh3-64 of the raw payload
     32    4 num_tokens   tokens covered by this chunk
     36    4 chunk_index  position of the chunk in its prefix (0 = first)
     40   16 fingerprint  layout fingerprint (namespace digest), zeros if unset
     56    4 header_check xxh32 of bytes 0..56, so a node can trust the fields
     60    4 reserved     0

Readers verify ``checksum`` before bytes reach an engine; a node verifies only
``header_check`` and the lengths on PUT, which is cheap, and leaves the
payload checksum to readers (the client verifies every read as it arrives).

A writer may send ``checksum`` after the payload instead (:class:`ChecksumTrailer`,
the PUT item flag ``PUT_FLAG_CHECKSUM_AFTER``): the header goes out with checksum 0
(``seal(deferred=True)``, its ``header_check`` over those bytes), the writer hashes its
payload while the node is still receiving it, and the node writes the 8 bytes that
follow the payload into the stored header (:func:`fill_checksum`). The checksum is the
writer's, of the writer's memory, either way.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import xxhash

from kvpool.protocol.errors import CorruptChunkError

__all__ = [
    "CODEC_BY_NAME",
    "CODEC_NAMES",
    "ENVELOPE_HEADER_SIZE",
    "ENVELOPE_MAGIC",
    "ENVELOPE_VERSION",
    "ZERO_FINGERPRINT",
    "ChecksumTrailer",
    "Codec",
    "EnvelopeHeader",
    "fill_checksum",
    "open_envelope",
    "payload_checksum",
    "seal",
]

ENVELOPE_MAGIC = b"KVPC"
ENVELOPE_VERSION = 1
ENVELOPE_HEADER_SIZE = 64
ZERO_FINGERPRINT = bytes(16)

_HEADER = struct.Struct("<4sBBBBQQQII16s")
_CHECK = struct.Struct("<I4x")
_U64 = struct.Struct("<Q")
#: where ``checksum`` lies in the header
_CHECKSUM_AT = 24
assert _HEADER.size + _CHECK.size == ENVELOPE_HEADER_SIZE


class Codec(enum.IntEnum):
    """How the payload is stored. Only RAW is produced today; the cold tiers add lz4."""

    RAW = 0
    LZ4 = 1
    SHUFFLE_LZ4 = 2


_RAW = Codec.RAW

#: the codecs by the names configuration, start-up lines and stats use
CODEC_BY_NAME = {"none": Codec.RAW, "lz4": Codec.LZ4, "shuffle-lz4": Codec.SHUFFLE_LZ4}
CODEC_NAMES = {codec: name for name, codec in CODEC_BY_NAME.items()}


Payload = bytes | bytearray | memoryview
#: a payload given as segments, stored as their concatenation
Segmented = Payload | list[Payload] | tuple[Payload, ...]


def payload_checksum(payload: Segmented) -> int:
    """xxh3-64 of a raw payload (or of its segments, in order), as stored in the envelope."""
    if isinstance(payload, (list, tuple)):
        hasher = xxhash.xxh3_64()
        for part in payload:
            hasher.update(part)
        return int(hasher.intdigest())
    return int(xxhash.xxh3_64_intdigest(payload))


class EnvelopeHeader(NamedTuple):
    """Decoded envelope header."""

    raw_len: int
    stored_len: int
    checksum: int
    num_tokens: int = 0
    chunk_index: int = 0
    fingerprint: bytes = ZERO_FINGERPRINT
    codec: Codec = Codec.RAW
    elem_size: int = 0

    def pack(self) -> bytes:
        head = _HEADER.pack(
            ENVELOPE_MAGIC,
            ENVELOPE_VERSION,
            self.codec,
            self.elem_size,
            0,
            self.raw_len,
            self.stored_len,
            self.checksum,
            self.num_tokens,
            self.chunk_index,
            self.fingerprint,
        )
        return head + _CHECK.pack(xxhash.xxh32_intdigest(head))

    @property
    def value_len(self) -> int:
        """Length of the whole stored value, header included."""
        return ENVELOPE_HEADER_SIZE + self.stored_len

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> EnvelopeHeader:
        """Decode and validate a header; raise CorruptChunkError if it is not one."""
        if len(buf) < ENVELOPE_HEADER_SIZE:
            raise CorruptChunkError(
                f"envelope header needs {ENVELOPE_HEADER_SIZE} bytes, got {len(buf)}"
            )
        (check,) = _CHECK.unpack_from(buf, _HEADER.size)
        if xxhash.xxh32_intdigest(buf[: _HEADER.size]) != check:
            raise CorruptChunkError("envelope header checksum mismatch")
        (magic, version, codec, elem_size, _flags, raw_len, stored_len, checksum, num_tokens,
         chunk_index, fingerprint) = _HEADER.unpack_from(buf)
        if magic != ENVELOPE_MAGIC:
            raise CorruptChunkError(f"bad envelope magic {magic!r}")
        if version != ENVELOPE_VERSION:
            raise CorruptChunkError(f"unsupported envelope version {version}")
        if codec == _RAW:  # (a module global: Codec.RAW costs an enum lookup each time)
            if raw_len != stored_len:
                raise CorruptChunkError("raw codec with raw_len != stored_len")
            codec_enum = _RAW
        else:
            try:
                codec_enum = Codec(codec)
            except ValueError:
                raise CorruptChunkError(f"unknown codec {codec}") from None
        return cls(raw_len, stored_len, checksum, num_tokens, chunk_index, fingerprint,
                   codec_enum, elem_size)


def seal(
    payload: Segmented,
    *,
    chunk_index: int = 0,
    num_tokens: int = 0,
    fingerprint: bytes = ZERO_FINGERPRINT,
    deferred: bool = False,
) -> bytes:
    """The header for storing ``payload`` raw. Send it followed by ``payload`` (no concat).

    ``payload`` may be a list of segments, stored as their concatenation. ``deferred``:
    checksum 0, the payload not read; its :class:`ChecksumTrailer` follows the payload.
    """
    if len(fingerprint) != 16:
        raise ValueError("fingerprint must be 16 bytes")
    if isinstance(payload, (list, tuple)):
        n = sum(memoryview(part).nbytes for part in payload)
    else:
        n = memoryview(payload).nbytes
    return EnvelopeHeader(
        raw_len=n,
        stored_len=n,
        checksum=0 if deferred else payload_checksum(payload),
        num_tokens=num_tokens,
        chunk_index=chunk_index,
        fingerprint=fingerprint,
    ).pack()


class ChecksumTrailer(bytearray):
    """The 8 bytes sent after a payload sealed with ``deferred=True``: its xxh3-64.

    A sender hashes the payload as it goes out: :meth:`update` with each piece once the
    piece is sent (its bytes still in cache, and the node reading them meanwhile), then
    :meth:`fill` before the trailer itself is sent (``fill`` alone hashes the whole
    payload). Until then the trailer is 8 zero bytes, a checksum no reader accepts.
    """

    __slots__ = ("_hashed", "_hasher", "segments")

    def __init__(self, payload: Segmented) -> None:
        super().__init__(8)
        #: the payload's parts, in order, as they lie in the frame before the trailer
        self.segments: list[Payload] = list(payload) if isinstance(payload, (list, tuple)) \
            else [payload]
        self._hasher = xxhash.xxh3_64()
        self._hashed = 0

    def update(self, piece: memoryview) -> None:
        self._hasher.update(piece)
        self._hashed += piece.nbytes

    def fill(self) -> None:
        if self._hashed == 0:
            digest = payload_checksum(self.segments)
        elif self._hashed == sum(memoryview(p).nbytes for p in self.segments):
            digest = self._hasher.intdigest()
        else:
            raise RuntimeError("checksum trailer: part of the payload was not hashed")
        _U64.pack_into(self, 0, digest)


def fill_checksum(value: memoryview, checksum: bytes | bytearray | memoryview) -> None:
    """A node's side of :class:`ChecksumTrailer`: write the checksum that followed
    ``value``'s payload into its envelope header and renew ``header_check``. A header
    whose ``header_check`` fails as sent is left as it is, for the commit to refuse."""
    if len(value) < ENVELOPE_HEADER_SIZE:
        return
    (check,) = _CHECK.unpack_from(value, _HEADER.size)
    if xxhash.xxh32_intdigest(value[: _HEADER.size]) != check:
        return
    value[_CHECKSUM_AT : _CHECKSUM_AT + 8] = checksum
    _CHECK.pack_into(value, _HEADER.size, xxhash.xxh32_intdigest(value[: _HEADER.size]))


def open_envelope(value: bytes | bytearray | memoryview) -> memoryview:
    """Validate a whole stored value and return its raw payload (RAW codec only)."""
    header = EnvelopeHeader.unpack(value)
    if len(value) != header.value_len:
        raise CorruptChunkError(
            f"envelope says {header.value_len} bytes, value has {len(value)}"
        )
    if header.codec is not Codec.RAW:
        raise CorruptChunkError(f"codec {header.codec.name} is not readable here")
    payload = memoryview(value)[ENVELOPE_HEADER_SIZE:]
    if payload_checksum(payload) != header.checksum:
        raise CorruptChunkError("payload checksum mismatch")
    return payload
