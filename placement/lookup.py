"""A prefix-lookup request (the admin API's ``POST /v1/lookup`` body) -> chunk keys.

Pure: bytes in, keys out. The node runs it inline for small bodies and in a
short-lived child process for large ones (``kvpool.server.admin.lookup_offload``):
decoding 4M tokens of JSON takes ~0.35 s in one C call that holds the GIL, so
a thread would not keep the event loop free.

The body is either ``{"keys": ["<32 hex>", ...]}`` or
``{"namespace": {<Namespace fields>}, "tokens": [int, ...]}``; a ``"scope"``
member, if present, is returned as given (the node checks it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvpool.placement.keys import ChunkHasher, Namespace, key_from_hex
from kvpool.protocol.errors import ConfigError
from kvpool.protocol.json_limits import check_depth

__all__ = ["MAX_LOOKUP_KEYS", "MAX_LOOKUP_TOKENS", "LookupRequest", "parse_lookup"]

#: the most tokens one lookup may carry: 4M token ids are ~28 MB of JSON
MAX_LOOKUP_TOKENS = 1 << 22
#: the most chunk keys one lookup may name (given, or hashed from its tokens): 4M tokens
#: at the default 256-token chunks. Bounds the node's own part of a lookup (key scoping
#: and tier look-ups run on its event loop, ~1 us a key).
MAX_LOOKUP_KEYS = 1 << 14


@dataclass(frozen=True, slots=True)
class LookupRequest:
    keys: list[bytes]
    #: the chunk size when the request gave tokens (None: it gave keys)
    chunk_tokens: int | None
    scope: object = ""


def parse_lookup(body: bytes) -> LookupRequest:
    """The keys a lookup body names; ConfigError (or InvalidKeyError) saying what is wrong."""
    check_depth(body)
    try:
        doc: Any = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"the body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError("the body must be a JSON object with 'keys' or 'namespace'+'tokens'")
    scope = doc.pop("scope", "")
    if "keys" in doc:
        if set(doc) != {"keys"}:
            raise ConfigError("give either 'keys' alone or 'namespace' and 'tokens'")
        keys = doc["keys"]
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ConfigError("'keys' must be a list of 32-hex-character strings")
        if len(keys) > MAX_LOOKUP_KEYS:
            raise ConfigError(f"at most {MAX_LOOKUP_KEYS} keys per lookup; split it")
        return LookupRequest([key_from_hex(k) for k in keys], None, scope)
    if set(doc) != {"namespace", "tokens"}:
        raise ConfigError("give either 'keys' alone or 'namespace' and 'tokens'")
    ns, tokens = doc["namespace"], doc["tokens"]
    if not isinstance(ns, dict):
        raise ConfigError("'namespace' must be an object of Namespace fields")
    if not isinstance(tokens, list) or len(tokens) > MAX_LOOKUP_TOKENS:
        raise ConfigError(f"'tokens' must be a list of at most {MAX_LOOKUP_TOKENS} token ids")
    try:
        namespace = Namespace(**ns)
    except TypeError as exc:
        raise ConfigError(f"bad namespace: {exc}") from None
    if len(tokens) // namespace.chunk_tokens > MAX_LOOKUP_KEYS:
        raise ConfigError(
            f"{len(tokens)} tokens are more than {MAX_LOOKUP_KEYS} chunks of "
            f"{namespace.chunk_tokens}: at most {MAX_LOOKUP_KEYS * namespace.chunk_tokens} "
            "tokens per lookup at this chunk size; split it")
    if not all(type(t) is int and 0 <= t < 1 << 32 for t in tokens):
        raise ConfigError("every token must be an integer in [0, 2**32)")
    return LookupRequest(ChunkHasher(namespace).keys(tokens), namespace.chunk_tokens, scope)
