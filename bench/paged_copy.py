"""Chunks into and out of paged KV blocks, by layout: what the GPU client's copies cost.

    python -m bench.paged_copy [--runs 9] [--chunks 16] [--threads 1]

SmolLM2-135M's geometry (30 layers, 3 KV heads, head dim 64, bf16), 256-token chunks,
vLLM's CPU block size 128, on the CPU. For each layout, ``scatter`` (a load: chunk ->
blocks) and ``gather`` (a store: blocks -> chunk) of ``--chunks`` chunks into blocks of
a 340-block cache per layer, and, in the same run, two baselines over the same bytes:

- ``memcpy``: copying the chunks into preallocated chunks (no layout work at all);
- ``cpu_attn via temporary``: the cpu_attn scatter as it was before (every layer's
  selected blocks built in one temporary by batched transposes, then an ``index_copy_``
  per layer), to show what the current one gains.

Every run times each series once, in turn (interleaved), so a ratio pairs samples from
the same stretch of a noisy machine. GB/s median [min-max] over ``--runs``; ratios are
medians of the per-run ratios. Written to ``bench/results/paged_copy.json``. Needs torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvpool.gpu.layout import KVLayout, LayoutKind
from kvpool.gpu.paged import gather, scatter

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS, HEADS, DIM, BLOCK, CHUNK_TOKENS, CACHE_BLOCKS = 30, 3, 64, 128, 256, 340
KINDS: tuple[LayoutKind, ...] = ("flash", "blocks_first", "cpu_attn")


def cache_shape(kind: LayoutKind) -> tuple[int, ...]:
    return {"flash": (2, CACHE_BLOCKS, BLOCK, HEADS, DIM),
            "blocks_first": (CACHE_BLOCKS, 2, BLOCK, HEADS, DIM),
            "cpu_attn": (CACHE_BLOCKS, HEADS, BLOCK, 2 * DIM)}[kind]


def scatter_via_temporary(layout: KVLayout, caches: Sequence[torch.Tensor],
                          ids: torch.Tensor, chunk: torch.Tensor) -> None:
    """The cpu_attn scatter before the direct one: the baseline it is measured against."""
    first = caches[0]
    b, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
    nb = len(ids)
    blocks = torch.empty((len(caches), nb, first.shape[1], first.shape[2] * first.shape[3]),
                         dtype=first.dtype)
    k = blocks[..., : b * d].view(len(caches), nb, h, d, b)
    v = blocks[..., b * d :].view(len(caches), nb, h, b, d)
    k.copy_(chunk[:, 0].view(len(caches), nb, b, h, d).permute(0, 1, 3, 4, 2))
    v.copy_(chunk[:, 1].view(len(caches), nb, b, h, d).permute(0, 1, 3, 2, 4))
    for layer, cache in enumerate(caches):
        cache.index_copy_(0, ids, blocks[layer].view(nb, *cache.shape[1:]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (vLLM's CPU worker on 2 cores gets 1)")
    parser.add_argument("--out", type=Path, default=RESULTS / "paged_copy.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = torch.bfloat16
    chunks = [torch.randn(LAYERS, 2, CHUNK_TOKENS, HEADS, DIM).to(dtype)
              for _ in range(args.chunks)]
    outs = [torch.empty_like(c) for c in chunks]
    per_chunk = CHUNK_TOKENS // BLOCK
    ids = [torch.arange(per_chunk) + 5 + per_chunk * i for i in range(args.chunks)]
    nbytes = sum(c.numel() * c.element_size() for c in chunks)

    def memcpy() -> None:
        for out, chunk in zip(outs, chunks, strict=True):
            out.copy_(chunk)

    series: dict[str, Callable[[], None]] = {"memcpy": memcpy}
    caches: dict[str, list[torch.Tensor]] = {}
    for kind in KINDS:
        layout = KVLayout(LAYERS, HEADS, DIM, dtype, BLOCK, kind=kind)
        caches[kind] = cache = [torch.randn(cache_shape(kind)).to(dtype) for _ in range(LAYERS)]

        def load(layout: KVLayout = layout, cache: list[torch.Tensor] = cache) -> None:
            for chunk, i in zip(chunks, ids, strict=True):
                scatter(layout, cache, i, chunk)

        def store(layout: KVLayout = layout, cache: list[torch.Tensor] = cache) -> None:
            for out, i in zip(outs, ids, strict=True):
                gather(layout, cache, i, out)

        series[f"{kind} scatter"] = load
        series[f"{kind} gather"] = store
        if kind == "cpu_attn":
            def load_tmp(layout: KVLayout = layout, cache: list[torch.Tensor] = cache) -> None:
                for chunk, i in zip(chunks, ids, strict=True):
                    scatter_via_temporary(layout, cache, i, chunk)

            series["cpu_attn scatter via temporary"] = load_tmp
    for kind in KINDS:  # round trips are exact
        cache = caches[kind]
        layout = KVLayout(LAYERS, HEADS, DIM, dtype, BLOCK, kind=kind)
        scatter(layout, cache, ids[0], chunks[0])
        gather(layout, cache, ids[0], outs[0])
        assert torch.equal(outs[0], chunks[0]), kind
    for fn in series.values():  # warm-up: first touch of every page
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in series}
    for _ in range(args.runs):
        for name, fn in series.items():
            started = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - started)
    rows: list[dict[str, Any]] = []
    base = seconds["memcpy"]
    tmp = seconds["cpu_attn scatter via temporary"]
    print(f"paged copies: {args.chunks} chunks of {CHUNK_TOKENS} tokens, {nbytes / 1e6:.0f} MB, "
          f"block {BLOCK}, {args.runs} interleaved runs, {args.threads} torch thread(s)")
    print(f"{'series':<32} {'GB/s median [min-max]':>24} {'/ memcpy':>9} {'/ via tmp':>10}")
    for name, times in seconds.items():
        rates = [nbytes / t / 1e9 for t in times]
        vs_memcpy = statistics.median(b / t for b, t in zip(base, times, strict=True))
        vs_tmp = (statistics.median(o / t for o, t in zip(tmp, times, strict=True))
                  if name.startswith("cpu_attn scatter") else None)
        rows.append({"series": name, "gb_s": statistics.median(rates), "min": min(rates),
                     "max": max(rates), "vs_memcpy": vs_memcpy, "vs_via_temporary": vs_tmp})
        print(f"{name:<32} {statistics.median(rates):>8.2f} [{min(rates):.2f}-{max(rates):.2f}]"
              f"{'':>5} {vs_memcpy:>8.3f}x {'' if vs_tmp is None else f'{vs_tmp:.2f}x':>10}")
    RESULTS.mkdir(exist_ok=True)
    args.out.write_text(json.dumps({"chunks": args.chunks, "bytes": nbytes, "runs": args.runs,
                                    "threads": args.threads, "rows": rows,
                                    "measured": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
