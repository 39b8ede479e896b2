"""Test data shaped like K/V activations, shared by the codec and tier tests."""

from __future__ import annotations

import numpy as np

from kvpool.protocol.envelope import seal


def bf16_like(n: int, seed: int = 0) -> bytes:
    """``n`` bf16 values with a narrow exponent range, like K/V activations: the high
    bytes (sign, exponent) repeat, the low bytes (mantissa) are noise."""
    fp32 = np.random.default_rng(seed).normal(0, 0.5, n).astype(np.float32)
    return (fp32.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def kv_envelope(n: int, index: int = 0) -> bytes:
    """A RAW envelope of ``bf16_like(n)`` at depth ``index`` (also its seed)."""
    payload = bf16_like(n, index)
    return seal(payload, chunk_index=index) + payload


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")
