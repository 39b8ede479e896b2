"""PUTs into a node whose DRAM tier is filling: memory allocated ahead vs page faults.

    python -m bench.fill              # ~1-2 minutes on 2 cores
    python -m bench.fill --quick      # smoke run

A node's arena is mapped at start, but the kernel allocates a page only when it is
first written, so every PUT into memory never used before pays a page fault per
4 KiB. Each round starts fresh nodes, one with ``--dram-allocate-ahead 0`` (faults)
and one with the default window (memory allocated by a background thread ahead of
what is stored), in alternating order, and times ``--count`` PUTs of distinct
``--size`` values into each over TCP and through shared memory (the fast path writes
into arena slots from the client, which maps each slot with one ``madvise`` first).
After the fill, the same PUTs again once every key is deleted: memory already
allocated and written, the ceiling. Prints a table (p50 / p99 ms over all calls of
the round, GB/s median [min-max] over rounds, ratios paired by round) and writes
bench/results/fill.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from bench._procs import start_node
from bench._stats import fmt, save, summary
from kvpool.client import Client

MiB = 1 << 20
VARIANTS = {"faults": "0", "allocate-ahead": "256MiB"}
PATHS = ("tcp", "shm")


def _puts(client: Client, keys: list[bytes], values: list[bytes]) -> list[float]:
    """Seconds each PUT took."""
    times = []
    for key, value in zip(keys, values, strict=True):
        t0 = time.perf_counter()
        client.put(key, value)
        times.append(time.perf_counter() - t0)
    return times


def _round(variant: str, path: str, values: list[bytes]) -> dict[str, list[float]]:
    capacity = len(values) * len(values[0]) * 2 + 512 * MiB
    node = start_node("--dram-capacity", f"{capacity // MiB}MiB", "--no-ssd",
                      "--dram-allocate-ahead", VARIANTS[variant])
    try:
        time.sleep(0.3)  # both variants alike: the window is allocated by then
        with Client(node.url, shm=path == "shm", pool_size=1) as client:
            keys = [os.urandom(16) for _ in values]
            fill = _puts(client, keys, values)
            client.delete_many(keys)
            again = _puts(client, keys, values)
    finally:
        node.stop()
    return {"fill": fill, "again": again}


def run(args: argparse.Namespace) -> dict[str, Any]:
    values = [os.urandom(args.size) for _ in range(args.count)]
    nbytes = args.size * args.count
    #: per series: each round's call times, and each round's GB/s
    times: dict[str, list[list[float]]] = {
        f"{path} {variant} {phase}": []
        for path in PATHS for variant in VARIANTS for phase in ("fill", "again")}
    for r in range(args.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for path in PATHS:
            for variant in order:
                for phase, calls in _round(variant, path, values).items():
                    times[f"{path} {variant} {phase}"].append(calls)
    out: dict[str, Any] = {"size": args.size, "count": args.count, "rounds": args.rounds,
                           "series": {}}
    for name, rounds in times.items():
        rates = [nbytes / sum(calls) / 1e9 for calls in rounds]
        every = sorted(t for calls in rounds for t in calls)
        out["series"][name] = {
            "gbs": summary(rates),
            "p50_ms": statistics.median(every) * 1e3,
            "p99_ms": every[min(len(every) - 1, int(0.99 * len(every)))] * 1e3,
            "rates": rates,
        }
    for path in PATHS:
        on = out["series"][f"{path} allocate-ahead fill"]["rates"]
        off = out["series"][f"{path} faults fill"]["rates"]
        out[f"{path}_fill_ratio"] = summary([a / b for a, b in zip(on, off, strict=True)])
    return out


def report(out: dict[str, Any]) -> None:
    print(f"\n{out['count']} PUTs of {out['size'] // 1024} KiB a node, {out['rounds']} rounds\n")
    print("| series | GB/s | p50 ms | p99 ms |\n|---|---|---|---|")
    for name, s in out["series"].items():
        print(f"| {name} | {fmt(s['gbs'])} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} |")
    for path in PATHS:
        print(f"{path}: allocate-ahead / faults while filling: "
              f"{fmt(out[f'{path}_fill_ratio'], 'x')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=MiB)
    parser.add_argument("--count", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1 round of 64 PUTs")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.count = 1, 64
    out = run(args)
    report(out)
    print(f"wrote {save('fill', out)}")


if __name__ == "__main__":
    main()
