"""Saves beside an engine's steps: the steps' pace with kvpool's save thread at the
engine's niceness and at ``save_nice`` (the vLLM connector's setting), against no saves.

    python -m bench.save_nice                 # 5 rounds of 6 s a setup, interleaved
    python -m bench.save_nice --rounds 3 --seconds 4

The "engine" is this process's main thread running a decode-like step (four 256x256
matmuls on one torch thread, and Python around them) as fast as it can; the "save
thread" puts 16 values of 256 KiB a call through a sync client to a node on this host
(over TCP), as the connector's save thread does after each prefill. Per setup: the
step's p50 and p99 (ms) and the MiB saved a second, median [min-max] over rounds; the
setups alternate within each round. The save thread's niceness is set as the
connector sets it (``kvpool.gpu.threads.nicer``: per thread, Linux). Writes
``bench/results/save_nice.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Any

import torch

from bench._procs import start_node
from bench._stats import fmt, save, summary
from kvpool.client import Client
from kvpool.gpu.threads import nicer

VALUE = 256 << 10
BATCH = 16


def _step(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    x = a
    for _ in range(4):
        x = torch.mm(x, b) * 0.01
    return [float(v) for v in x[0, :64]]


def one(url: str, nice: int | None, seconds: float) -> dict[str, float]:
    """Step times for ``seconds`` beside a save thread at ``nice`` (None: no saves)."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    stop = threading.Event()
    saved = [0]

    def saver() -> None:
        nicer(nice or 0)
        values = [os.urandom(VALUE) for _ in range(BATCH)]
        with Client(url, shm=False) as client:
            i = 0
            while not stop.is_set():
                client.put_many([(i * BATCH + j).to_bytes(16, "big") for j in range(BATCH)],
                                values)
                saved[0] += BATCH
                i += 1

    for _ in range(50):
        _step(a, b)
    thread = None
    if nice is not None:
        thread = threading.Thread(target=saver, daemon=True)
        thread.start()
        time.sleep(0.3)
    times: list[float] = []
    start = time.monotonic()
    saved[0] = 0
    while time.monotonic() - start < seconds:
        t = time.perf_counter()
        _step(a, b)
        times.append(time.perf_counter() - t)
    elapsed = time.monotonic() - start
    stop.set()
    if thread is not None:
        thread.join(10)
    return {"p50_ms": statistics.median(times) * 1e3,
            "p99_ms": statistics.quantiles(times, n=100)[98] * 1e3,
            "saved_mib_s": saved[0] * VALUE / 2**20 / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.save_nice", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--nice", type=int, default=10, help="the save thread's (default 10)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    setups: dict[str, int | None] = {"no saves": None, "saves, nice 0": 0,
                                     f"saves, nice {args.nice}": args.nice}
    got: dict[str, dict[str, list[float]]] = {name: {} for name in setups}
    node = start_node("--no-ssd", "--dram-capacity", "512MiB")
    try:
        for r in range(args.rounds):
            order = list(setups) if r % 2 == 0 else list(reversed(setups))
            for name in order:
                for key, value in one(node.url, setups[name], args.seconds).items():
                    got[name].setdefault(key, []).append(value)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        node.stop()
    print(f"\nengine steps beside saves ({os.cpu_count()} CPUs; median [min-max] of "
          f"{args.rounds} rounds of {args.seconds:g} s)\n")
    print("| setup | step p50 | step p99 | saved |")
    print("|---|---|---|---|")
    out: dict[str, Any] = {"rounds": args.rounds, "seconds": args.seconds,
                           "cpus": os.cpu_count(), "setups": {}}
    for name in setups:
        row = {k: summary(v) for k, v in got[name].items()}
        out["setups"][name] = row
        print(f"| {name} | {fmt(row['p50_ms'], ' ms')} | {fmt(row['p99_ms'], ' ms')} | "
              f"{fmt(row['saved_mib_s'], ' GiB/s', 1 / 1024) if name != 'no saves' else '-'} |")
    print(f"\nwrote {save('save_nice', out)}")


if __name__ == "__main__":
    main()
