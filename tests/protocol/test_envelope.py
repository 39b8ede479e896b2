from __future__ import annotations

import os

import pytest

from kvpool.protocol.envelope import (
    ENVELOPE_HEADER_SIZE,
    Codec,
    EnvelopeHeader,
    open_envelope,
    seal,
)
from kvpool.protocol.errors import CorruptChunkError


def test_roundtrip() -> None:
    payload = os.urandom(1000)
    header = seal(payload, chunk_index=3, num_tokens=256, fingerprint=b"f" * 16)
    assert len(header) == ENVELOPE_HEADER_SIZE
    parsed = EnvelopeHeader.unpack(header)
    assert (parsed.raw_len, parsed.stored_len, parsed.chunk_index, parsed.num_tokens,
            parsed.fingerprint, parsed.codec) == (1000, 1000, 3, 256, b"f" * 16, Codec.RAW)
    assert bytes(open_envelope(header + payload)) == payload


@pytest.mark.parametrize("offset", [0, 5, 8, 24, 36, 40, 59])
def test_any_header_bit_flip_is_caught(offset: int) -> None:
    payload = b"x" * 64
    value = bytearray(seal(payload) + payload)
    value[offset] ^= 0x01
    with pytest.raises(CorruptChunkError):
        open_envelope(value)


def test_payload_corruption_is_caught() -> None:
    payload = os.urandom(4096)
    value = bytearray(seal(payload) + payload)
    value[ENVELOPE_HEADER_SIZE + 4000] ^= 0x80
    with pytest.raises(CorruptChunkError, match="checksum"):
        open_envelope(value)


def test_truncated_value_is_caught() -> None:
    payload = os.urandom(100)
    value = seal(payload) + payload
    with pytest.raises(CorruptChunkError):
        open_envelope(value[:-1])
    with pytest.raises(CorruptChunkError):
        EnvelopeHeader.unpack(value[:10])


def test_bad_fingerprint_length() -> None:
    with pytest.raises(ValueError):
        seal(b"x", fingerprint=b"short")
