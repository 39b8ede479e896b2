"""Content-addressed chunk keys: chained xxh3-128 over the token prefix.

The scheme (docs/keys.md has the spec and tests/vectors the test vectors)::

    ns      = xxh3_128(canonical_json(namespace fields)).digest()
    key_0   = xxh3_128(ns || tok_0).digest()
    key_i   = xxh3_128(ns || key_{i-1} || tok_i).digest()

``tok_i`` is chunk i's token ids packed as little-endian uint32; only full
chunks get keys. ``canonical_json`` is ``json.dumps(fields, sort_keys=True,
separators=(",", ":"), ensure_ascii=False).encode("utf-8")`` with unset
optional fields (tenant, adapter) omitted. A key therefore names the whole
prefix up to and including its chunk, for one model/layout/tenant only.
"""

from __future__ import annotations

import json
import re
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import xxhash

from kvpool.protocol.errors import ConfigError, InvalidKeyError
from kvpool.protocol.frames import KEY_SIZE

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "ChunkHasher",
    "Namespace",
    "canonical_json",
    "key_from_hex",
    "key_to_hex",
    "pack_tokens",
]

DEFAULT_CHUNK_TOKENS = 128
#: engine-native chunk formats (see Namespace.kv_format)
_ENGINE_FORMAT = re.compile(r"((mla|cpu_attn(_amx)?-block[1-9][0-9]*)-)?"
                            r"layers[0-9]+-[1-9][0-9]*"
                            r"|cpu_attn(_amx)?-block[1-9][0-9]*"
                            r"|sglang(-[a-z0-9_]+)+-pp[0-9]+of[1-9][0-9]*")
_MAX_TOKEN = 0xFFFFFFFF


def canonical_json(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode("utf-8")


@dataclass(frozen=True, slots=True)
class Namespace:
    """What the tensors mean. Chunks of different namespaces never share a key."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    tp_size: int = 1
    tp_rank: int = 0
    tenant: str | None = None
    adapter: str | None = None
    #: what a chunk's payload is: None = K and V per KV head in the canonical,
    #: engine-neutral layout; "mla" = one latent vector a token (num_kv_heads 1, head_dim =
    #: latent dim); "cpu_attn-block<N>" / "cpu_attn_amx-block<N>" = vLLM CPU_ATTN's own
    #: block bytes (vec / AMX kernels), block size N (an engine-native format: readable
    #: only by engines with the same blocks); "sglang-<layout>[-mla][-<format>]-pp<R>of<S>"
    #: = pages of SGLang's HiCache host pool in that layout, of pipeline stage R of S;
    #: a "layers<A>-<B>" part (alone, or after "-") = only the model's layers A to B-1
    #: (a vLLM pipeline stage)
    kv_format: str | None = None

    def __post_init__(self) -> None:
        for name in ("model", "dtype", "tenant", "adapter", "kv_format"):
            value = getattr(self, name)
            if value is None and name not in ("model", "dtype"):
                continue
            if not isinstance(value, str):
                raise ConfigError(f"namespace {name} must be a string, got {value!r}")
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ConfigError(f"namespace {name} is not valid Unicode text") from None
        if not self.model:
            raise ConfigError("namespace model must be a non-empty string")
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens", "tp_size",
                     "tp_rank"):
            value = getattr(self, name)
            if type(value) is not int:
                raise ConfigError(f"namespace {name} must be an integer, got {value!r}")
            if value < (0 if name == "tp_rank" else 1):
                raise ConfigError(f"namespace {name} must be >= {0 if name == 'tp_rank' else 1}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} outside [0, tp_size={self.tp_size})")
        if self.kv_format not in (None, "mla") and not _ENGINE_FORMAT.fullmatch(self.kv_format):
            raise ConfigError(f"namespace kv_format must be None, 'mla', 'cpu_attn-block<N>', "
                              f"'cpu_attn_amx-block<N>', any of these then '-layers<A>-<B>' "
                              f"(or that alone), or 'sglang-<layout>...-pp<R>of<S>', "
                              f"got {self.kv_format!r}")

    def fields(self) -> dict[str, Any]:
        """The fields hashed into the digest; unset optional ones are omitted."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @property
    def digest(self) -> bytes:
        """16-byte namespace digest (also the envelope's layout fingerprint)."""
        return bytes(xxhash.xxh3_128_digest(canonical_json(self.fields())))


def pack_tokens(tokens: Iterable[int]) -> bytes:
    """Token ids as little-endian uint32; raise ValueError outside [0, 2**32)."""
    try:
        packed = array("I", tokens)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, {_MAX_TOKEN}]: {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - no mainstream platform has this
        packed = array("L", packed)
    if sys.byteorder != "little":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


class ChunkHasher:
    """Computes chunk keys for one namespace.

    >>> ns = Namespace(model="m", dtype="bf16", num_layers=2, num_kv_heads=1, head_dim=8,
    ...                chunk_tokens=4)
    >>> len(ChunkHasher(ns).keys(range(10)))  # two full chunks, two tokens left over
    2
    """

    __slots__ = ("_chunk_tokens", "_ns", "namespace")

    def __init__(self, namespace: Namespace) -> None:
        self.namespace = namespace
        self._ns = namespace.digest
        self._chunk_tokens = namespace.chunk_tokens

    @property
    def chunk_tokens(self) -> int:
        return self._chunk_tokens

    def num_chunks(self, num_tokens: int) -> int:
        """How many full chunks (and therefore keys) ``num_tokens`` tokens make."""
        return num_tokens // self._chunk_tokens

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        """Keys of every full chunk of ``tokens``, in prefix order."""
        packed = pack_tokens(tokens)
        step = 4 * self._chunk_tokens
        keys: list[bytes] = []
        parent = b""
        for start in range(0, len(packed) - step + 1, step):
            parent = xxhash.xxh3_128_digest(self._ns + parent + packed[start : start + step])
            keys.append(parent)
        return keys

    def next_key(self, parent: bytes | None, chunk: Sequence[int]) -> bytes:
        """The key of ``chunk`` following ``parent`` (None for the first chunk)."""
        if len(chunk) != self._chunk_tokens:
            raise ValueError(f"a chunk has exactly {self._chunk_tokens} tokens, got {len(chunk)}")
        if parent is not None and len(parent) != KEY_SIZE:
            raise InvalidKeyError(f"parent key must be {KEY_SIZE} bytes")
        return bytes(xxhash.xxh3_128_digest(self._ns + (parent or b"") + pack_tokens(chunk)))

    def hex_keys(self, tokens: Sequence[int]) -> list[str]:
        return [key.hex() for key in self.keys(tokens)]


def key_to_hex(key: bytes) -> str:
    """32 lowercase hex characters, as used in REST, logs and S3 object names."""
    if len(key) != KEY_SIZE:
        raise InvalidKeyError(f"a key is {KEY_SIZE} bytes, got {len(key)}")
    return key.hex()


def key_from_hex(text: str) -> bytes:
    """Parse 32 hex characters into a 16-byte key."""
    if len(text) != 2 * KEY_SIZE:
        raise InvalidKeyError(f"a hex key is {2 * KEY_SIZE} characters, got {len(text)}")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise InvalidKeyError(f"not a hex key: {text!r}") from None
