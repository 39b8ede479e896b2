"""kvpool placement: chunk keys from tokens (later: hash ring, cluster map). Pure."""

from kvpool.placement.keys import (
    DEFAULT_CHUNK_TOKENS,
    ChunkHasher,
    Namespace,
    canonical_json,
    key_from_hex,
    key_to_hex,
    pack_tokens,
)

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "ChunkHasher",
    "Namespace",
    "canonical_json",
    "key_from_hex",
    "key_to_hex",
    "pack_tokens",
]
