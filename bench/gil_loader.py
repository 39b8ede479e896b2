"""Why kvpool's load thread slows a CPU engine's forward though it runs on another CPU:
the GIL. An engine-like step beside the connector's cache writes, from a thread of the
engine's process and from a process of its own, on another CPU.

    python -m bench.gil_loader               # 5 rounds of 3 s a setup, interleaved
    python -m bench.gil_loader --rounds 3 --seconds 2

The "engine" is this process's main thread on CPU 0 running a decode-like step (30
layers of small bf16 matmuls and activations on one torch thread: many short torch
calls, as a forward of a small model on a CPU makes). The "loader" writes canonical
chunks (SmolLM2-135M's geometry: 30 layers, 3 KV heads of 64, 256-token chunks) into
``cpu_attn`` blocks as the vLLM connector does, over and over, on CPU 1: with kvpool's
scatter (one ``torch._foreach_copy_`` a chunk) and, where vLLM is installed, with vLLM's
own cache-write op (one call a layer, ``VllmCacheWrite``, which the connector uses for
AMX blocks), and vLLM's op behind the connector's write batch (``WriteBatch``: each chunk
copied into it, then one call a layer for up to 8 chunks, as a load in place writes them).
Setups: the engine alone; each writer in a thread of this process; kvpool's writer in a
process of its own. Per setup: the step's p50 over the engine alone's, and
the loader's GB/s, median [min-max] over rounds. Needs torch and 2 CPUs; writes
``bench/results/gil_loader.json``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench._stats import fmt, save, summary
from kvpool.gpu.in_place import WriteBatch
from kvpool.gpu.layout import KVLayout
from kvpool.gpu.paged import CpuAttnScatter, Scatter

LAYERS, HEADS, DIM, BLOCK, CHUNK_BLOCKS, CHUNKS = 30, 3, 64, 128, 2, 16


def _layout(kind: str) -> KVLayout:
    return KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                    dtype=torch.bfloat16, block_size=BLOCK, kind=kind)  # type: ignore[arg-type]


def _writer(name: str, caches: list[torch.Tensor]) -> tuple[KVLayout, Scatter]:
    if name.startswith("vllm op"):
        from kvpool.gpu.vllm import VllmCacheWrite

        layout, write = _layout("cpu_attn_amx"), VllmCacheWrite(caches, "amx")
        return layout, (_batched(layout, write, caches) if "batched" in name else write)
    layout = _layout("cpu_attn")
    return layout, CpuAttnScatter(layout, caches)


def _batched(layout: KVLayout, write: Scatter, caches: list[torch.Tensor]) -> Scatter:
    """``write`` behind a :class:`WriteBatch`, as :func:`kvpool.gpu.in_place.load_in_place`
    drives it (a full batch is written before the next chunk goes in)."""
    batch = WriteBatch(layout, CHUNK_BLOCKS * BLOCK)

    def add(layout: KVLayout, caches: Sequence[torch.Tensor], ids: torch.Tensor,
            chunk: torch.Tensor, *, first_block: int = 0) -> None:
        batch.make_room(len(ids), write, list(caches))
        batch.add(chunk, ids, first_block)

    return add


def _loader(name: str, stop: Any, out: Any) -> None:
    """Write chunks on CPU 1 until ``stop``; ``out`` gets the bytes written a second."""
    os.sched_setaffinity(0, {1})
    torch.set_num_threads(1)
    caches = [torch.zeros(CHUNKS * CHUNK_BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16)
              for _ in range(LAYERS)]
    layout, write = _writer(name, caches)
    chunks = [torch.randn(LAYERS, 2, CHUNK_BLOCKS * BLOCK, HEADS, DIM, dtype=torch.bfloat16)
              for _ in range(CHUNKS)]
    ids = [torch.arange(i * CHUNK_BLOCKS, (i + 1) * CHUNK_BLOCKS) for i in range(CHUNKS)]
    written = 0
    started = time.perf_counter()
    while not stop.is_set():
        for chunk, blocks in zip(chunks, ids, strict=True):
            write(layout, caches, blocks, chunk)
            written += chunk.numel() * chunk.element_size()
    out.put(written / (time.perf_counter() - started))


def _steps(seconds: float) -> float:
    """The engine-like step's median (s) over ``seconds``."""
    weights = [torch.randn(576, 576, dtype=torch.bfloat16) for _ in range(LAYERS)]
    x = torch.randn(4, 576, dtype=torch.bfloat16)
    times: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        y = x
        for w in weights:
            for _ in range(8):
                y = torch.nn.functional.silu(y @ w) * 0.5
        times.append(time.perf_counter() - t)
    return statistics.median(times[3:] or times)


def one(setup: str, seconds: float) -> dict[str, float]:
    """The step's median beside ``setup``'s loader (``alone``: none), and its GB/s."""
    if setup == "alone":
        return {"step_ms": _steps(seconds) * 1e3}
    name, where = setup.rsplit(", ", 1)
    ctx = mp.get_context("fork")
    if where == "thread":
        stop: Any = threading.Event()
        out: Any = queue.Queue()
        worker: Any = threading.Thread(target=_loader, args=(name, stop, out), daemon=True)
    else:
        stop, out = ctx.Event(), ctx.Queue()
        worker = ctx.Process(target=_loader, args=(name, stop, out), daemon=True)
    worker.start()
    time.sleep(0.5)
    step = _steps(seconds)
    stop.set()
    rate = out.get(timeout=60)
    worker.join(30)
    return {"step_ms": step * 1e3, "loader_gb_s": rate / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gil_loader", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        raise SystemExit("needs CPUs 0 and 1")
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    setups = ["alone", "kvpool scatter, thread", "kvpool scatter, process"]
    try:  # imported here, not in the loader threads (an import holds the GIL throughout)
        import kvpool.gpu.vllm  # noqa: F401
        setups += ["vllm op, thread", "vllm op batched, thread"]
    except ImportError:
        print("(vLLM not installed: its op's setup left out)")
    got: dict[str, dict[str, list[float]]] = {s: {} for s in setups}
    for r in range(args.rounds):
        for setup in setups if r % 2 == 0 else list(reversed(setups)):
            for key, value in one(setup, args.seconds).items():
                got[setup].setdefault(key, []).append(value)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    alone = statistics.median(got["alone"]["step_ms"])
    print(f"\nan engine-like step on CPU 0 beside chunk writes on CPU 1 (median [min-max] of "
          f"{args.rounds} rounds of {args.seconds:g} s; the step alone {alone:.1f} ms)\n")
    print("| loader | step / alone | loader writes |")
    print("|---|---|---|")
    out: dict[str, Any] = {"rounds": args.rounds, "seconds": args.seconds, "setups": {}}
    for setup in setups:
        row: dict[str, Any] = {k: summary(v) for k, v in got[setup].items()}
        row["step_ratio"] = summary([v / alone for v in got[setup]["step_ms"]])
        out["setups"][setup] = row
        rate = fmt(row["loader_gb_s"], " GB/s") if "loader_gb_s" in row else "-"
        print(f"| {setup} | {fmt(row['step_ratio'], 'x')} | {rate} |")
    print(f"\nwrote {save('gil_loader', out)}")


if __name__ == "__main__":
    main()
