"""Chunk keys: the spec's test vectors, an independent reference, and properties."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import xxhash

from kvpool.placement.keys import ChunkHasher, Namespace, key_from_hex, key_to_hex, pack_tokens
from kvpool.protocol.errors import ConfigError, InvalidKeyError
from tests.conftest import ROOT

VECTORS = json.loads((ROOT / "tests" / "vectors" / "chunk_keys.json").read_text())


def reference_keys(fields: dict[str, object], tokens: list[int]) -> list[str]:
    """The scheme written straight from docs/keys.md, sharing no code with kvpool."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False).encode("utf-8")
    ns = xxhash.xxh3_128(canonical).digest()
    size = int(fields["chunk_tokens"])  # type: ignore[call-overload]
    keys, parent = [], b""
    for start in range(0, len(tokens) - size + 1, size):
        chunk = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + size])
        parent = xxhash.xxh3_128(ns + parent + chunk).digest()
        keys.append(parent.hex())
    return keys


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=lambda v: v["namespace"]["model"][:20])
def test_vectors(vector: dict[str, object]) -> None:
    ns = Namespace(**vector["namespace"])  # type: ignore[arg-type]
    tokens = vector["tokens"]
    assert ns.digest.hex() == vector["namespace_digest"]
    assert ChunkHasher(ns).hex_keys(tokens) == vector["keys"]  # type: ignore[arg-type]
    fields = {"chunk_tokens": 256, "tp_size": 1, "tp_rank": 0, **vector["namespace"]}  # type: ignore[dict-item]
    assert reference_keys(fields, tokens) == vector["keys"]  # type: ignore[arg-type]


def test_key_names_whole_prefix() -> None:
    h = ChunkHasher(Namespace("m", "float16", 2, 1, 8, chunk_tokens=4))
    a = h.keys([1, 2, 3, 4, 5, 6, 7, 8])
    b = h.keys([9, 2, 3, 4, 5, 6, 7, 8])  # same second chunk, different first
    assert a[1] != b[1]
    assert h.keys([1, 2, 3, 4, 5, 6, 7, 8, 9]) == a  # a partial chunk gets no key
    assert h.next_key(a[0], [5, 6, 7, 8]) == a[1]
    assert h.next_key(None, [1, 2, 3, 4]) == a[0]


def test_namespace_separates_models_and_tenants() -> None:
    base = dict(model="m", dtype="float16", num_layers=2, num_kv_heads=1, head_dim=8,
                chunk_tokens=4)
    tokens = list(range(8))
    variants = [Namespace(**base), Namespace(**{**base, "tenant": "a"}),  # type: ignore[arg-type]
                Namespace(**{**base, "tenant": "b"}), Namespace(**{**base, "adapter": "x"}),  # type: ignore[arg-type]
                Namespace(**{**base, "dtype": "bfloat16"}), Namespace(**{**base, "tp_size": 2})]  # type: ignore[arg-type]
    firsts = {ChunkHasher(ns).keys(tokens)[0] for ns in variants}
    assert len(firsts) == len(variants)
    assert "tenant" not in Namespace(**base).fields()  # type: ignore[arg-type]


def test_deterministic_across_processes() -> None:
    code = ("from kvpool.placement.keys import ChunkHasher, Namespace;"
            "print(ChunkHasher(Namespace('m','bf16',2,1,8,chunk_tokens=4)).hex_keys(range(12)))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": seed}, check=True).stdout
            for seed in ("1", "2", "random")}
    assert len(outs) == 1


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        pack_tokens([-1])
    with pytest.raises(ValueError):
        pack_tokens([2**32])
    with pytest.raises(ConfigError):
        Namespace("m", "f16", 0, 1, 8)
    with pytest.raises(ConfigError):
        Namespace("m", "f16", 1, 1, 8, tp_size=2, tp_rank=2)
    with pytest.raises(InvalidKeyError):
        key_from_hex("abc")
    with pytest.raises(InvalidKeyError):
        key_to_hex(b"short")
    assert key_from_hex(key_to_hex(bytes(range(16)))) == bytes(range(16))
