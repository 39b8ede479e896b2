"""Regenerate tests/vectors/chunk_keys.json (only when the spec changes on purpose).

    python tests/vectors/generate.py > tests/vectors/chunk_keys.json
"""

from __future__ import annotations

import json

from kvpool.placement.keys import ChunkHasher, Namespace, canonical_json


def lcg_tokens(n: int, seed: int, vocab: int) -> list[int]:
    """Deterministic token ids without any RNG library: x = (a*x + c) mod 2**32."""
    out, x = [], seed
    for _ in range(n):
        x = (1664525 * x + 1013904223) % 2**32
        out.append(x % vocab)
    return out


CASES = [
    ({"model": "meta-llama/Llama-3.1-8B", "dtype": "bfloat16", "num_layers": 32,
      "num_kv_heads": 8, "head_dim": 128, "chunk_tokens": 256}, lcg_tokens(1000, 1, 128256)),
    ({"model": "tiny", "dtype": "float16", "num_layers": 2, "num_kv_heads": 1, "head_dim": 8,
      "chunk_tokens": 4, "tp_size": 2, "tp_rank": 1}, list(range(18))),
    ({"model": "tiny", "dtype": "float16", "num_layers": 2, "num_kv_heads": 1, "head_dim": 8,
      "chunk_tokens": 4, "tenant": "acme", "adapter": "sql-lora"}, list(range(18))),
    ({"model": "Qwen/Qwen2.5-7B-Instruct — ünïcode", "dtype": "float8_e4m3fn", "num_layers": 28,
      "num_kv_heads": 4, "head_dim": 128, "chunk_tokens": 16},
     [0, 4294967295, *lcg_tokens(46, 7, 2**32)]),
    ({"model": "tiny", "dtype": "float16", "num_layers": 2, "num_kv_heads": 1, "head_dim": 8,
      "chunk_tokens": 4}, [1, 2, 3]),
]


def main() -> None:
    vectors = []
    for fields, tokens in CASES:
        ns = Namespace(**fields)  # type: ignore[arg-type]
        vectors.append({
            "namespace": fields,
            "canonical_json": canonical_json(ns.fields()).decode("utf-8"),
            "namespace_digest": ns.digest.hex(),
            "tokens": tokens,
            "keys": ChunkHasher(ns).hex_keys(tokens),
        })
    print(json.dumps({"scheme": "kvpool chunk keys v1", "vectors": vectors}, indent=1,
                     ensure_ascii=False))


if __name__ == "__main__":
    main()
