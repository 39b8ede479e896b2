"""Payload codecs for the cold tiers: raw, lz4, and byte-shuffle + lz4.

A codec rewrites a stored value (an envelope) into another envelope whose
header names the codec; the checksum always covers the *raw* payload, so
``decode`` verifies the bytes an engine will see. Byte-shuffle groups the
i-th byte of every ``elem_size``-byte element together (all high bytes of
the fp16/bf16 values, then all low bytes), which gives lz4 runs to find in
KV tensors whose exponents repeat.
"""

from __future__ import annotations

from typing import Any

import lz4.block
import numpy as np

from kvpool.protocol.envelope import (
    ENVELOPE_HEADER_SIZE,
    Codec,
    EnvelopeHeader,
    payload_checksum,
)
from kvpool.protocol.errors import CorruptChunkError

__all__ = ["decode", "encode", "shuffle", "unshuffle"]

Buffer = bytes | bytearray | memoryview


# Byte planes are cut with shifts on an unsigned view of the elements: a numpy
# transpose of (n, 2) bytes copies byte by byte and measured slower than slicing.
_UINT: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def shuffle(data: Buffer, elem_size: int) -> bytes:
    """Group byte i of every element: ``b0 b0' .. b1 b1' ..``; a tail shorter
    than one element is kept as is at the end."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if elem_size <= 1:
        return raw.tobytes()
    body = len(raw) - len(raw) % elem_size
    dtype = _UINT.get(elem_size)
    if dtype is None:
        planes = raw[:body].reshape(-1, elem_size).T
    else:
        values = raw[:body].view(dtype)
        planes = np.stack([(values >> (8 * i)).astype(np.uint8) for i in range(elem_size)])
    return planes.tobytes() + raw[body:].tobytes()


def unshuffle(data: Buffer, elem_size: int) -> bytes:
    raw = np.frombuffer(data, dtype=np.uint8)
    if elem_size <= 1:
        return raw.tobytes()
    body = len(raw) - len(raw) % elem_size
    planes = raw[:body].reshape(elem_size, -1)
    dtype = _UINT.get(elem_size)
    if dtype is None:
        return planes.T.tobytes() + raw[body:].tobytes()
    values = planes[0].astype(dtype)
    for i in range(1, elem_size):
        values |= planes[i].astype(dtype) << (8 * i)
    out: bytes = values.tobytes()
    return out + raw[body:].tobytes()


def encode(value: Buffer, codec: Codec, elem_size: int = 2) -> bytes:
    """Re-encode a RAW envelope with ``codec``. Falls back to RAW if that is smaller."""
    header = EnvelopeHeader.unpack(value)
    if header.codec is not Codec.RAW:
        raise ValueError(f"encode expects a RAW envelope, got {header.codec.name}")
    payload = memoryview(value)[ENVELOPE_HEADER_SIZE : ENVELOPE_HEADER_SIZE + header.stored_len]
    if codec is Codec.RAW:
        return bytes(value)
    stored: bytes
    if codec is Codec.LZ4:
        stored = lz4.block.compress(payload, store_size=False)
        elem = 0
    elif codec is Codec.SHUFFLE_LZ4:
        stored = lz4.block.compress(shuffle(payload, elem_size), store_size=False)
        elem = elem_size
    else:  # pragma: no cover - Codec is closed
        raise ValueError(f"unknown codec {codec}")
    if len(stored) >= header.raw_len:  # incompressible: storing it compressed only costs
        return bytes(value)
    new = header._replace(codec=codec, stored_len=len(stored), elem_size=elem)
    return new.pack() + stored


def decode(value: Buffer) -> bytes:
    """A RAW envelope from any stored envelope, its checksum verified.

    Raises CorruptChunkError if the header, the codec stream or the checksum is bad.
    """
    header = EnvelopeHeader.unpack(value)
    if len(value) != header.value_len:
        raise CorruptChunkError(f"envelope says {header.value_len} bytes, value has {len(value)}")
    stored = memoryview(value)[ENVELOPE_HEADER_SIZE:]
    if header.codec is Codec.RAW:
        raw: Buffer = stored
    else:
        try:
            raw = lz4.block.decompress(stored, uncompressed_size=header.raw_len)
        except lz4.block.LZ4BlockError as exc:
            raise CorruptChunkError(f"lz4 stream is corrupt: {exc}") from exc
        if header.codec is Codec.SHUFFLE_LZ4:
            raw = unshuffle(raw, header.elem_size)
    if len(raw) != header.raw_len or payload_checksum(raw) != header.checksum:
        raise CorruptChunkError("payload checksum mismatch")
    if header.codec is Codec.RAW:
        return bytes(value)
    return header._replace(codec=Codec.RAW, stored_len=header.raw_len,
                           elem_size=0).pack() + bytes(raw)
