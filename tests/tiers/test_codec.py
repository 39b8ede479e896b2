"""Codecs: every codec round-trips to the same RAW envelope; corruption is caught."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE, Codec, EnvelopeHeader, seal
from kvpool.protocol.errors import CorruptChunkError
from kvpool.tiers.codec import decode, encode, shuffle, unshuffle
from tests.kvdata import bf16_like


def kv_like(n: int = 50_000) -> bytes:
    return bf16_like(n)


def envelope(payload: bytes) -> bytes:
    return seal(payload, chunk_index=2, num_tokens=16) + payload


@given(st.binary(max_size=300), st.integers(1, 8))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_shuffle_roundtrip(data: bytes, elem: int) -> None:
    assert bytes(unshuffle(shuffle(data, elem), elem)) == data


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("payload", [kv_like(), os.urandom(10_000), b"", b"z" * 100_001],
                         ids=["kv-fp16", "random", "empty", "zeros-odd"])
def test_roundtrip(codec: Codec, payload: bytes) -> None:
    value = envelope(payload)
    stored = encode(value, codec)
    assert decode(stored) == value


def test_compresses_kv_and_falls_back_on_random() -> None:
    kv = envelope(kv_like())
    shuffled = encode(kv, Codec.SHUFFLE_LZ4)
    assert EnvelopeHeader.unpack(shuffled).codec is Codec.SHUFFLE_LZ4
    assert len(shuffled) < 0.9 * len(kv)
    assert len(shuffled) < len(encode(kv, Codec.LZ4))  # shuffling is what makes it pay
    noise = envelope(os.urandom(20_000))
    assert EnvelopeHeader.unpack(encode(noise, Codec.LZ4)).codec is Codec.RAW


@pytest.mark.parametrize("codec", [Codec.LZ4, Codec.SHUFFLE_LZ4])
def test_corrupt_stored_bytes_are_caught(codec: Codec) -> None:
    stored = bytearray(encode(envelope(kv_like()), codec))
    stored[ENVELOPE_HEADER_SIZE + len(stored) // 3] ^= 0x10
    with pytest.raises(CorruptChunkError):
        decode(stored)


def test_truncated_is_caught() -> None:
    stored = encode(envelope(kv_like()), Codec.LZ4)
    with pytest.raises(CorruptChunkError):
        decode(stored[:-5])
