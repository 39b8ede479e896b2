"""Cluster benchmarks against real node processes, each with its single-node baseline.

1. Cluster-wide prefix lookup of a 128k-token prompt (512 chunk keys, all
   present) through ``AsyncClient.lookup_tiers``: a 3-node cluster
   (replication 1 and 2: every owner asked at once, one round trip) versus
   one standalone node (one LOOKUP frame). p50/p99 over many calls.
   "1 node, cluster map" is the same node with a one-node map: the client
   routes (ring, picks, fan-out) but talks to one process, which separates
   the cost of routing from the cost of more processes sharing the cores.
   The same through the sync ``Client`` (what the vLLM connector's scheduler
   calls: its own uvloop loop, or the blocking socket for a standalone node).
2. GET throughput with 2 client processes (``get_many_into``, 8 x 1 MiB
   per call, preallocated buffers) against a 3-node cluster and against
   one node, same run, same data. On a 2-core machine this shows whether
   routing costs anything, not a speed-up.

    python -m bench.cluster [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpool.cli.local_cluster import LocalCluster
from kvpool.client import AsyncClient, Client

MiB = 1 << 20
NODE_ARGS = ["--no-ssd", "--dram-capacity", "1GiB"]


def keys_for(n: int, salt: int) -> list[bytes]:
    return [salt.to_bytes(4, "little") + i.to_bytes(4, "little") + bytes(8) for i in range(n)]


async def lookup_latency(seeds: list[str], samples: int) -> dict[str, float]:
    keys = keys_for(512, 1)
    async with AsyncClient(seeds) as c:
        await c.put_many(keys, [b"k" * 64] * len(keys))
        assert await c.lookup(keys) == 512
        times = []
        for _ in range(samples):
            t = time.perf_counter()
            await c.lookup_tiers(keys)
            times.append(time.perf_counter() - t)
    times.sort()
    return {"p50_ms": statistics.median(times) * 1e3,
            "p99_ms": times[int(0.99 * (len(times) - 1))] * 1e3,
            "min_ms": times[0] * 1e3}


def sync_lookup_latency(seeds: list[str], samples: int) -> dict[str, float]:
    keys = keys_for(512, 1)  # stored by lookup_latency
    with Client(seeds) as c:
        assert c.lookup(keys) == 512
        times = []
        for _ in range(samples):
            t = time.perf_counter()
            c.lookup_tiers(keys)
            times.append(time.perf_counter() - t)
    times.sort()
    return {"p50_ms": statistics.median(times) * 1e3,
            "p99_ms": times[int(0.99 * (len(times) - 1))] * 1e3,
            "min_ms": times[0] * 1e3}


async def fill(seeds: list[str], num_values: int, size: int) -> None:
    keys = keys_for(num_values, 2)
    value = os.urandom(size)
    async with AsyncClient(seeds) as c:
        for i in range(0, num_values, 8):
            await c.put_many(keys[i : i + 8], [value] * len(keys[i : i + 8]))


async def _worker(seeds: list[str], num_values: int, size: int, total_bytes: int,
                  *, per_call: int = 8, shm: bool = True) -> float:
    keys = keys_for(num_values, 2)
    buffers = [bytearray(size) for _ in range(per_call)]
    async with AsyncClient(seeds, shm=shm) as c:
        await c.get_many_into(keys[:per_call], buffers)  # connect and warm up
        moved = 0
        i = 0
        t = time.perf_counter()
        while moved < total_bytes:
            batch = [keys[(i + j) % num_values] for j in range(per_call)]
            got = await c.get_many_into(batch, buffers)
            if None in got:
                raise RuntimeError("a value went missing during the benchmark")
            moved += size * per_call
            i += per_call
        return moved / (time.perf_counter() - t) / 1e9


def get_throughput(seeds: list[str], num_values: int, size: int, total_bytes: int,
                   processes: int, *, batch: int = 8, shm: bool = True) -> float:
    """Aggregate GB/s of ``processes`` client processes started together, each reading
    ``batch`` values a call (``shm``: through shared memory where the node offers it)."""
    cmd = [sys.executable, "-m", "bench.cluster", "--worker", ",".join(seeds),
           str(num_values), str(size), str(total_bytes), str(batch), str(int(shm))]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    rates = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"worker failed: {out}")
        rates.append(float(out.strip().splitlines()[-1]))
    return sum(rates)


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"lookup": {}, "sync lookup": {}, "get": {}}
    num_values = 64
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as tmp:
        setups = {"1 node": LocalCluster(1, replication=1, data_dir=f"{tmp}/one",
                                         serve_args=NODE_ARGS, standalone=True),
                  "1 node, cluster map": LocalCluster(1, replication=1, data_dir=f"{tmp}/map1",
                                                      serve_args=NODE_ARGS),
                  "3 nodes r=1": LocalCluster(3, replication=1, data_dir=f"{tmp}/r1",
                                              serve_args=NODE_ARGS),
                  "3 nodes r=2": LocalCluster(3, replication=2, data_dir=f"{tmp}/r2",
                                              serve_args=NODE_ARGS)}
        for name, cluster in setups.items():
            with cluster:
                seeds = cluster.seeds
                results["lookup"][name] = asyncio.run(lookup_latency(seeds, args.samples))
                results["sync lookup"][name] = sync_lookup_latency(seeds, args.samples)
                asyncio.run(fill(seeds, num_values, MiB))
                rates = [get_throughput(seeds, num_values, MiB, args.mib * MiB, 2)
                         for _ in range(args.runs)]
                results["get"][name] = {"median_gbps": statistics.median(rates),
                                        "min_gbps": min(rates), "max_gbps": max(rates)}
            print(f"  {name}: done", flush=True)
    return results


def table(results: dict[str, Any]) -> str:
    base_get = results["get"]["1 node"]["median_gbps"]
    base_lookup = results["lookup"]["1 node"]["p50_ms"]
    out = ["| setup | lookup 512 keys p50 | p99 | ÷ 1 node p50 | sync Client p50 | p99 "
           "| GET 2 procs GB/s median [min-max] | ÷ 1 node |",
           "|---|---|---|---|---|---|---|---|"]
    for name in results["get"]:
        lk, g = results["lookup"][name], results["get"][name]
        sl = results["sync lookup"][name]
        out.append(f"| {name} | {lk['p50_ms']:.2f} ms | {lk['p99_ms']:.2f} ms "
                   f"| {lk['p50_ms'] / base_lookup:.2f}x | {sl['p50_ms']:.2f} ms "
                   f"| {sl['p99_ms']:.2f} ms | {g['median_gbps']:.2f} "
                   f"[{g['min_gbps']:.2f}-{g['max_gbps']:.2f}] "
                   f"| {g['median_gbps'] / base_get:.2f}x |")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        seeds, num_values, size, total, batch, shm = \
            sys.argv[2].split(","), *map(int, sys.argv[3:8])
        print(asyncio.run(_worker(seeds, num_values, size, total, per_call=batch,
                                  shm=bool(shm))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mib", type=int, default=512, help="MiB each client process reads")
    parser.add_argument("--samples", type=int, default=1000, help="lookups timed per setup")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results/cluster.json"))
    args = parser.parse_args()
    if args.quick:
        args.runs, args.mib, args.samples = 1, 128, 200
    results = run(args)
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
