"""How far the placement design goes past one machine: rings of 10, 100 and 1,000 nodes.

For each ring size, nodes get mixed weights (1, 2 or 4: think 64, 128 and
256 GiB of DRAM), and 10M random keys are streamed through it in batches
(never held at once). Reported per size:

- balance: the most loaded node's keys per unit of weight, over the mean
  (1.00 is perfect);
- moved on join / leave: the fraction of keys whose first owner changes when
  one node of weight 1 joins or one node leaves, over the ideal fraction
  (that node's share of the weight); and whether any key moved between two
  nodes that both stayed (must be 0);
- ring memory and build time;
- owners() latency: 512 keys with 3 owners each (one prompt of 128k tokens
  at 256 tokens per chunk), and 1 key, median of many calls.

    python -m bench.placement_sim            # 10M keys
    python -m bench.placement_sim --keys 1e6 # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.placement.ring import Ring, key_positions

WEIGHTS = (1.0, 2.0, 4.0)


def weighted_nodes(n: int, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    return {f"10.{i // 250}.{i % 250}.1:7700": float(rng.choice(WEIGHTS)) for i in range(n)}


def stream(num_keys: int, batch: int, seed: int):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    left = num_keys
    while left > 0:
        size = min(batch, left)
        yield rng.integers(0, 2**64 - 1, size=size, dtype=np.uint64, endpoint=True)
        left -= size


def simulate(n: int, num_keys: int, batch: int, seed: int) -> dict[str, Any]:
    weights = weighted_nodes(n, seed)
    t0 = time.perf_counter()
    ring = Ring(weights, width=3)
    build_s = time.perf_counter() - t0
    joiner = "10.99.99.1:7700"
    joined = Ring({**weights, joiner: 1.0}, width=3)
    leaver = sorted(weights)[len(weights) // 2]
    left = Ring({k: w for k, w in weights.items() if k != leaver}, width=3)
    # node index maps from each ring into the base ring's order (joiner = n)
    universe = {name: i for i, name in enumerate(ring.nodes)}
    universe[joiner] = n
    to_base = {id(r): np.array([universe[x] for x in r.nodes]) for r in (ring, joined, left)}
    counts = np.zeros(n + 1, dtype=np.int64)
    moved_join = moved_leave = strays = 0
    for positions in stream(num_keys, batch, seed + 1):
        base = to_base[id(ring)][ring.owner_indexes(positions, 1)[:, 0]]
        counts += np.bincount(base, minlength=n + 1)
        after = to_base[id(joined)][joined.owner_indexes(positions, 1)[:, 0]]
        moved = base != after
        moved_join += int(moved.sum())
        strays += int((after[moved] != n).sum())
        after = to_base[id(left)][left.owner_indexes(positions, 1)[:, 0]]
        moved = base != after
        moved_leave += int(moved.sum())
        strays += int((base[moved] != universe[leaver]).sum())
    w = np.array([weights[x] for x in ring.nodes])
    per_weight = counts[:n] / w
    total_w = w.sum()
    ideal_join = 1.0 / (total_w + 1.0)
    ideal_leave = weights[leaver] / total_w
    blob = os.urandom(16 * 512)
    many, one = [], []
    key = os.urandom(16)
    for _ in range(300):
        t = time.perf_counter()
        ring.owner_indexes(key_positions(blob), 3)
        many.append(time.perf_counter() - t)
        t = time.perf_counter()
        ring.owners(key, 3)
        one.append(time.perf_counter() - t)
    return {
        "nodes": n, "keys": num_keys, "points": ring.num_points,
        "balance_max_over_mean": float(per_weight.max() / per_weight.mean()),
        "balance_min_over_mean": float(per_weight.min() / per_weight.mean()),
        "moved_join_fraction": moved_join / num_keys, "ideal_join_fraction": ideal_join,
        "moved_leave_fraction": moved_leave / num_keys, "ideal_leave_fraction": ideal_leave,
        "moves_between_staying_nodes": strays,
        "ring_bytes": ring.nbytes, "build_s": build_s,
        "owners_512_us_p50": statistics.median(many) * 1e6,
        "owners_1_us_p50": statistics.median(one) * 1e6,
    }


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| nodes | points | keys | balance max/mean (min) | moved on join ÷ ideal "
           "| moved on leave ÷ ideal | strays | ring memory | build | owners(512 keys, r=3) "
           "| owners(1 key) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['nodes']} | {r['points']:,} | {r['keys'] / 1e6:.0f}M "
            f"| {r['balance_max_over_mean']:.3f} ({r['balance_min_over_mean']:.3f}) "
            f"| {r['moved_join_fraction']:.4f} ÷ {r['ideal_join_fraction']:.4f} = "
            f"{r['moved_join_fraction'] / r['ideal_join_fraction']:.2f}x "
            f"| {r['moved_leave_fraction']:.4f} ÷ {r['ideal_leave_fraction']:.4f} = "
            f"{r['moved_leave_fraction'] / r['ideal_leave_fraction']:.2f}x "
            f"| {r['moves_between_staying_nodes']} | {r['ring_bytes'] / 2**20:.1f} MiB "
            f"| {r['build_s'] * 1e3:.0f} ms | {r['owners_512_us_p50']:.0f} us "
            f"| {r['owners_1_us_p50']:.0f} us |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,100,1000", help="ring sizes, comma-separated")
    parser.add_argument("--keys", type=float, default=10e6, help="keys per ring (streamed)")
    parser.add_argument("--batch", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench/results/placement_sim.json"))
    args = parser.parse_args()
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        rows.append(simulate(n, int(args.keys), args.batch, args.seed))
        print(f"  {n} nodes done", flush=True)
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
