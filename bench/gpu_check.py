"""One short check of the GPU client on a CUDA machine (under 5 minutes).

    python -m bench.gpu_check            # needs torch with CUDA and a GPU

1. pinned vs pageable host-to-device copy GB/s (the ceiling of a load);
2. a local node, paged KV caches on the GPU (Llama-3-8B geometry: 32 layers, 8 KV
   heads, head dim 128, bf16, blocks of 16; chunks of 256 tokens = 32 MiB), in
   each ``--kinds`` layout (default: ``bhnc``, the views vLLM >= 0.32 gives its GPU
   backends, over memory in vLLM's LBNHC order; and ``flash``, vLLM < 0.32's
   tensors): store GB/s, load into paged blocks GB/s, and plain get_many_into into
   host memory of the same chunks, same run;
3. bit-exactness: the loaded blocks equal the stored ones on the device.

Prints a table and writes bench/results/gpu_check.json. Without CUDA it says so
and exits 2 (the CPU path is covered by the test suite and bench.gpu_kv);
``--device cpu`` runs the same code on the CPU, to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from bench._procs import start_node
from kvpool.client import Client
from kvpool.gpu import KVLayout, PagedKVConnector

RESULTS = Path(__file__).resolve().parent / "results"


def _h2d(nbytes: int, runs: int, pinned: bool) -> list[float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates = []
    for _ in range(runs):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(nbytes / (start.elapsed_time(end) / 1000) / 1e9)
    return rates


def _caches(layout: KVLayout, num_blocks: int, device: str) -> list[torch.Tensor]:
    """The engine's per-layer tensors: ``bhnc`` views over one buffer in vLLM's LBNHC
    order (``[L, B, N, H, C]`` in memory), dense tensors for the other kinds."""
    if layout.kind != "bhnc":
        return [torch.randn(layout.layer_shape(num_blocks), device=device)
                .to(layout.dtype) for _ in range(layout.num_layers)]
    b, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
    physical = torch.randn(layout.num_layers, num_blocks, b, h, 2 * d,
                           device=device).to(layout.dtype)
    return list(physical.permute(0, 1, 3, 2, 4).unbind(0))


def _measure(client: Client, kind: str, args: argparse.Namespace
             ) -> tuple[dict[str, list[float]], bool, int]:
    """Store, load and get_many_into rates (GB/s per run), bit-exactness, chunk bytes."""
    layout = KVLayout(32, 8, 128, torch.bfloat16, 16, kind=kind)  # type: ignore[arg-type]
    chunk_tokens = 256
    per_chunk = chunk_tokens // layout.block_size
    num_blocks = 2 * args.chunks * per_chunk
    caches = _caches(layout, num_blocks, args.device)
    tokens = list(range(args.chunks * chunk_tokens))
    src = list(range(args.chunks * per_chunk))
    dst = list(range(args.chunks * per_chunk, num_blocks))
    nbytes = layout.chunk_nbytes(chunk_tokens)
    total = args.chunks * nbytes
    host = [bytearray(nbytes) for _ in range(args.chunks)]
    rates: dict[str, list[float]] = {"store": [], "load": [], "get_many_into": []}
    exact = True
    at_src, at_dst = ((slice(None), ids) if kind == "flash" else (ids,) for ids in (src, dst))

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.runs):
        ns = layout.namespace(f"gpu-check-{uuid.uuid4().hex[:8]}", chunk_tokens=chunk_tokens)
        for c in caches:
            c[at_dst] = 0
        with PagedKVConnector(client, layout, caches, ns, direct=False) as conn:
            sync()
            t0 = time.perf_counter()
            conn.store(tokens, src)
            rates["store"].append(total / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            loaded = conn.load(tokens, dst)
            sync()
            rates["load"].append(total / (time.perf_counter() - t0) / 1e9)
            keys = conn._async.hasher.keys(tokens)
        exact &= loaded == len(tokens) and all(
            torch.equal(c[at_src], c[at_dst]) for c in caches)
        t0 = time.perf_counter()
        client.get_many_into(keys, host)
        rates["get_many_into"].append(total / (time.perf_counter() - t0) / 1e9)
        client.delete_many(keys)
    return rates, exact, nbytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--kinds", default="bhnc,flash",
                        help="paged layouts to measure, comma-separated")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_check.json")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing measured", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0)
                              if args.device == "cuda" else "cpu", "torch": torch.__version__}
    if args.device == "cuda":
        result["h2d_pinned_gbs"] = statistics.median(_h2d(256 << 20, 10, True))
        result["h2d_pageable_gbs"] = statistics.median(_h2d(256 << 20, 10, False))
    total = args.chunks * KVLayout(32, 8, 128, torch.bfloat16, 16).chunk_nbytes(256)
    node = start_node("--dram-capacity", f"{2 * total // 2**20 + 256}MiB", "--no-ssd")
    exact = True
    print(f"| {result['device']} | GB/s median [min-max] |\n|---|---|")
    for name in ("h2d_pinned_gbs", "h2d_pageable_gbs"):
        if name in result:
            print(f"| {name.removesuffix('_gbs').replace('_', ' ')} | {result[name]:.1f} |")
    try:
        with Client(node.url) as client:
            for kind in args.kinds.split(","):
                rates, kind_exact, nbytes = _measure(client, kind, args)
                exact &= kind_exact
                out: dict[str, Any] = {f"{name}_gbs": {
                    "median": statistics.median(v), "min": min(v), "max": max(v)}
                    for name, v in rates.items()}
                out["load_ratio"] = out["load_gbs"]["median"] / \
                    out["get_many_into_gbs"]["median"]
                out["bit_exact"] = kind_exact
                result[kind] = out
                for name in rates:
                    r = out[f"{name}_gbs"]
                    print(f"| {kind} {name} ({args.chunks} x {nbytes >> 20} MiB) | "
                          f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}] |")
                print(f"{kind}: load / get_many_into {out['load_ratio']:.2f}x; "
                      f"bit-exact: {kind_exact}")
    finally:
        node.stop()
    result["bit_exact"] = exact
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
