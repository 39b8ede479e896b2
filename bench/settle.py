"""Settling under load: does a busy cluster's lookup leave a healthy node behind, and do
the saves after it keep their replicas?

A lookup or EXISTS on a cluster *settles*: once every key has an answer, a node still
silent after the grace (``client/_routing.py``: 4x what the answers took, 50 ms at
least) is left behind and kept from reads and writes until it answers (docs/cluster.md).
That is right for a hung node and wrong for a merely busy one. This runs what an
engine does, a lookup of 512 keys (half held) and a save (``exists_many`` of 4 new
keys, then ``put_many`` of those missing, 64 KiB each), round after round, against 3
DRAM-only nodes (replication 2, one fallback), while ``--loaders`` other client
processes put and get 4 x 4 MiB values as fast as they can (the 2-core VM saturated).
Per load: the rounds, the nodes left behind (``Client.num_left_behind``), lookup p50 /
p99, and how many copies of each saved key the nodes hold (every one should have 2:
a write that avoids a node left behind goes to the fallback; the nodes have room for
everything, so nothing is evicted, which the table checks).

    python -m bench.settle                 # loads 0, 2, 4; 15 s each
    python -m bench.settle --quick         # loads 0, 2; 4 s each
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from bench._stats import save
from kvpool.cli.local_cluster import LocalCluster
from kvpool.client import Client

NODE_ARGS = ["--no-ssd", "--dram-capacity", "2GiB"]

#: one loader: puts and gets 4 x 4 MiB values until its time is up
_LOADER = r"""
import os, sys, time
from kvpool.client import Client
seeds, seconds = sys.argv[1], float(sys.argv[2])
with Client(seeds) as c:
    keys = [os.urandom(16) for _ in range(4)]
    values = [os.urandom(4 << 20) for _ in range(4)]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        c.put_many(keys, values)
        c.get_many(keys)
"""


def _json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.load(reply)


def _copies(cluster: LocalCluster, key: bytes) -> int:
    """How many nodes hold ``key`` (their admin API says)."""
    held = 0
    for node in cluster.nodes:
        try:
            _json(f"{node.admin_url}/v1/chunks/{key.hex()}")
            held += 1
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
    return held


def one_load(loaders: int, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvpool-settle-") as tmp:
        cluster = LocalCluster(3, replication=2, data_dir=tmp, serve_args=NODE_ARGS)
        cluster.start()
        try:
            seeds = ",".join(cluster.seeds)
            procs = [subprocess.Popen([sys.executable, "-c", _LOADER, seeds, str(seconds)])
                     for _ in range(loaders)]
            saved: list[bytes] = []
            times: list[float] = []
            with Client(seeds) as client:
                held = [os.urandom(16) for _ in range(256)]
                client.put_many(held, [b"h" * 1024] * len(held))
                asked = held + [os.urandom(16) for _ in range(256)]
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    start = time.perf_counter()
                    client.lookup(asked)
                    times.append(time.perf_counter() - start)
                    batch = [os.urandom(16) for _ in range(4)]
                    new = [k for k, there in zip(batch, client.exists_many(batch), strict=True)
                           if not there]
                    client.put_many(new, [os.urandom(64 << 10) for _ in new])
                    saved += new
                left_behind = client.num_left_behind
            for proc in procs:
                if proc.wait(120) != 0:
                    raise RuntimeError(f"a loader failed (exit {proc.returncode})")
            evictions = sum(_json(f"{n.admin_url}/v1/stats")["evictions"]
                            for n in cluster.nodes)
            copies = [_copies(cluster, key) for key in saved]
        finally:
            cluster.stop()
    times.sort()
    return {"loaders": loaders, "rounds": len(times), "left_behind": left_behind,
            "lookup_p50_ms": times[len(times) // 2] * 1e3,
            "lookup_p99_ms": times[int(0.99 * (len(times) - 1))] * 1e3,
            "saved": len(saved), "evictions": evictions,
            "copies": {str(n): copies.count(n) for n in sorted(set(copies))}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="seconds a load")
    parser.add_argument("--loaders", default="0,2,4",
                        help="comma-separated numbers of loader processes")
    parser.add_argument("--quick", action="store_true", help="loads 0 and 2, 4 s each")
    args = parser.parse_args()
    loads = [0, 2] if args.quick else [int(n) for n in args.loaders.split(",")]
    seconds = 4.0 if args.quick else args.seconds
    rows = []
    for loaders in loads:
        rows.append(one_load(loaders, seconds))
        print(f"  measured {loaders} loader(s)", flush=True)
    print("\n| loaders | rounds | left behind | lookup p50 / p99 ms | keys saved | evictions "
          "| copies of each saved key |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        copies = ", ".join(f"{n}: {count}" for n, count in r["copies"].items())
        print(f"| {r['loaders']} | {r['rounds']} | {r['left_behind']} | "
              f"{r['lookup_p50_ms']:.2f} / {r['lookup_p99_ms']:.2f} | {r['saved']} | "
              f"{r['evictions']} | {copies} |")
    out = save("settle", {"seconds": seconds, "loads": rows})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
