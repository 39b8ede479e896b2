"""One short check of the GPU client on a CUDA machine (under 5 minutes).

    python -m kvpool.bench.gpu_check            # needs torch with CUDA and a GPU

1. pinned vs pageable host-to-device copy GB/s (the ceiling of a load);
2. a local node, paged KV caches on the GPU (Llama-3-8B geometry: 32 layers, 8 KV
   heads, head dim 128, bf16, vLLM flash layout, blocks of 16; chunks of 256
   tokens = 32 MiB): store GB/s, load into paged blocks GB/s, and plain
   get_many_into into host memory of the same chunks, same run;
3. bit-exactness: the loaded blocks equal the stored ones on the device.

Prints a table and writes bench/results/gpu_check.json. Without CUDA it says so
and exits 2 (the CPU path is covered by the test suite and bench.gpu_kv).
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

from kvpool.bench._procs import start_node
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_check.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing measured", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0),
                              "torch": torch.__version__}
    result["h2d_pinned_gbs"] = statistics.median(_h2d(256 << 20, 10, True))
    result["h2d_pageable_gbs"] = statistics.median(_h2d(256 << 20, 10, False))

    layout = KVLayout(32, 8, 128, torch.bfloat16, 16)
    chunk_tokens = 256
    per_chunk = chunk_tokens // layout.block_size
    num_blocks = 2 * args.chunks * per_chunk
    caches = [torch.randn(layout.layer_shape(num_blocks), device="cuda").to(torch.bfloat16)
              for _ in range(layout.num_layers)]
    tokens = list(range(args.chunks * chunk_tokens))
    src = list(range(args.chunks * per_chunk))
    dst = list(range(args.chunks * per_chunk, num_blocks))
    nbytes = layout.chunk_nbytes(chunk_tokens)
    total = args.chunks * nbytes
    host = [bytearray(nbytes) for _ in range(args.chunks)]
    rates: dict[str, list[float]] = {"store": [], "load": [], "get_many_into": []}
    exact = True
    node = start_node("--dram-capacity", f"{2 * total // 2**20 + 256}MiB", "--no-ssd")
    try:
        with Client(node.url) as client:
            for _ in range(args.runs):
                ns = layout.namespace(f"gpu-check-{uuid.uuid4().hex[:8]}",
                                      chunk_tokens=chunk_tokens)
                for c in caches:
                    c[:, dst] = 0
                with PagedKVConnector(client, layout, caches, ns) as conn:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    conn.store(tokens, src)
                    rates["store"].append(total / (time.perf_counter() - t0) / 1e9)
                    t0 = time.perf_counter()
                    loaded = conn.load(tokens, dst)
                    torch.cuda.synchronize()
                    rates["load"].append(total / (time.perf_counter() - t0) / 1e9)
                    keys = conn._async.hasher.keys(tokens)
                exact &= loaded == len(tokens) and all(
                    torch.equal(c[:, src], c[:, dst]) for c in caches)
                t0 = time.perf_counter()
                client.get_many_into(keys, host)
                rates["get_many_into"].append(total / (time.perf_counter() - t0) / 1e9)
                client.delete_many(keys)
    finally:
        node.stop()
    for name, values in rates.items():
        result[f"{name}_gbs"] = {"median": statistics.median(values), "min": min(values),
                                 "max": max(values)}
    result["load_ratio"] = result["load_gbs"]["median"] / result["get_many_into_gbs"]["median"]
    result["bit_exact"] = exact
    print(f"| {result['device']} | GB/s median [min-max] |\n|---|---|")
    print(f"| H2D pinned | {result['h2d_pinned_gbs']:.1f} |")
    print(f"| H2D pageable | {result['h2d_pageable_gbs']:.1f} |")
    for name in rates:
        r = result[f"{name}_gbs"]
        print(f"| {name} ({args.chunks} x {nbytes >> 20} MiB) | {r['median']:.2f} "
              f"[{r['min']:.2f}-{r['max']:.2f}] |")
    print(f"load / get_many_into: {result['load_ratio']:.2f}x; bit-exact: {exact}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
