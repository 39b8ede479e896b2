"""``kvpool serve --nodes 2`` against ``kvpool serve`` (one node) on the same host: batch GET
throughput from client processes on that host.

Both run as a user starts them (the real command, each with the same DRAM in all), side by
side for the whole run; rounds alternate between them. Each round: ``clients`` client
processes (``AsyncClient.get_many_into``, ``batch`` values of ``size`` a call into
preallocated buffers, the same keys in both) read ``mib`` MiB each, over TCP (what a
client on another host gets, and where the nodes do the work) and then through shared
memory (a client on the same host: it copies from the arena itself and the node only
says where the values are); the table gives the aggregate GB/s, median [min-max] over
the rounds, and N=2 over N=1 (the median of each round's ratio).

A node is one Python process on one event loop, so it serves from about one core; N nodes
can use N. The client is Python too: on a host with fewer cores than nodes plus client
processes, they take turns on the same cores and the ratio says so.

    python -m bench.serve_nodes [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cluster import fill, get_throughput
from kvpool.cli.local_cluster import free_port_run

MiB = 1 << 20


class Served:
    """``kvpool serve [--nodes N]`` in a process of its own, until :meth:`stop`."""

    def __init__(self, nodes: int, data_dir: str, dram: str) -> None:
        port = free_port_run(2 * nodes)
        cmd = [sys.executable, "-m", "kvpool.cli", "serve", "--data-dir", data_dir,
               "--data-port", str(port), "--admin-port", str(port + 1), "--no-ssd",
               "--dram-capacity", dram, "--log-level", "warning"]
        if nodes > 1:
            cmd += ["--nodes", str(nodes)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.seeds = [f"127.0.0.1:{port + 2 * i}" for i in range(nodes)]
        ready = re.compile(r"cluster ready|kvpool: ready")
        deadline = time.monotonic() + 120
        lines: list[str] = []
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("kvpool serve exited:\n" + "".join(lines))
            lines.append(line)
            if ready.search(line):
                return
        self.stop()
        raise RuntimeError("kvpool serve was not ready in 120 s:\n" + "".join(lines))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def run(args: argparse.Namespace) -> dict[str, Any]:
    num_values = 64 * MiB // args.size * max(1, args.batch // 8)
    rates: dict[str, dict[str, list[float]]] = {"N=1": {}, "N=2": {}}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as tmp:
        served = {"N=1": Served(1, f"{tmp}/one", args.dram),
                  "N=2": Served(2, f"{tmp}/two", args.dram)}
        try:
            for s in served.values():
                asyncio.run(fill(s.seeds, num_values, args.size))
            for r in range(args.runs):
                for shm in (False, True):
                    for clients in args.clients:
                        order = list(served) if r % 2 == 0 else list(reversed(served))
                        for name in order:
                            rate = get_throughput(served[name].seeds, num_values, args.size,
                                                  args.mib * MiB, clients, batch=args.batch,
                                                  shm=shm)
                            cell = f"{'shared memory' if shm else 'TCP'}, {clients}"
                            rates[name].setdefault(cell, []).append(rate)
                print(f"  round {r + 1}/{args.runs} done", flush=True)
        finally:
            for s in served.values():
                s.stop()
    return {"size": args.size, "batch": args.batch, "mib_per_client": args.mib,
            "cores": os.cpu_count(), "rates_gbps": rates}


def table(results: dict[str, Any]) -> str:
    rates = results["rates_gbps"]
    out = [f"GET {results['batch']} x {results['size'] // 1024} KiB a call, "
           f"{results['cores']} cores; GB/s median [min-max]",
           "",
           "| path, client processes | kvpool serve (1 node) | kvpool serve --nodes 2 "
           "| N=2 ÷ N=1 |",
           "|---|---|---|---|"]
    for cell in rates["N=1"]:
        one, two = rates["N=1"][cell], rates["N=2"][cell]
        ratios = [b / a for a, b in zip(one, two, strict=True)]
        out.append(f"| {cell} | {statistics.median(one):.2f} [{min(one):.2f}-{max(one):.2f}]"
                   f" | {statistics.median(two):.2f} [{min(two):.2f}-{max(two):.2f}] "
                   f"| {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
                   " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--clients", default="1,2", help="client processes, comma-separated")
    parser.add_argument("--size", type=int, default=256 << 10, help="bytes a value")
    parser.add_argument("--batch", type=int, default=16, help="values a GET call")
    parser.add_argument("--mib", type=int, default=512, help="MiB each client reads a round")
    parser.add_argument("--dram", default="1GiB", help="DRAM of the host (split by --nodes)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results/serve_nodes.json"))
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    if args.quick:
        args.runs, args.mib = 2, 128
    results = run(args)
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
