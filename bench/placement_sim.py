"""How far the placement design goes past one machine: rings of 10, 100 and 1,000 nodes.

For each ring size, nodes get mixed weights (1, 2 or 4: think 64, 128 and
256 GiB of DRAM), and 10M random keys are streamed through it in batches
(never held at once). Reported per size:

- balance: the most loaded node's keys per unit of weight, over the mean
  (1.00 is perfect), and the same exactly, from the ring's arcs (no key sampling);
- moved on join / leave: the fraction of keys whose first owner changes when
  one node of weight 1 joins or one node leaves, over the ideal fraction
  (that node's share of the weight); and whether any key moved between two
  nodes that both stayed (must be 0);
- ring memory and build time;
- owners() latency: 512 keys with 3 owners each (one prompt of 128k tokens
  at 256 tokens per chunk), and 1 key, median of many calls.

Then failure domains: 1,000 nodes on 100 hosts (10 a host) in 10 racks (10
hosts a rack) and 3 zones (racks 4/3/3), weights as above, 3 copies a key.
Reported: keys with two copies on one host, one rack, one zone (the map
allows 0 of each); load (copies a node holds per unit of weight) max/mean, from
the keys and exactly, and the same with every zone's weights scaled to equal totals; and for a
host moving to another rack, a host, a rack and a zone leaving, and a host
and a node joining, the copies moved (a key's owners after that were not
before, summed) over the minimum (the copies the leavers held, or the joiners hold after; for a
host moved to another rack and zone, the copies it holds after and did not
before, plus the keys whose copies its new labels make share a domain).

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

from kvpool.placement.ring import Domain, Ring, key_positions

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
        "balance_exact": exact_balance(ring, weights, 1),
        "moved_join_fraction": moved_join / num_keys, "ideal_join_fraction": ideal_join,
        "moved_leave_fraction": moved_leave / num_keys, "ideal_leave_fraction": ideal_leave,
        "moves_between_staying_nodes": strays,
        "ring_bytes": ring.nbytes, "build_s": build_s,
        "owners_512_us_p50": statistics.median(many) * 1e6,
        "owners_1_us_p50": statistics.median(one) * 1e6,
    }


#: copies of each key in the failure-domain simulation
COPIES = 3


def labelled_nodes(hosts: int, per_host: int, hosts_per_rack: int, zones: int, seed: int
                   ) -> tuple[dict[str, float], dict[str, Domain]]:
    """Nodes ``h<host>-n<i>``; host h in rack h // hosts_per_rack; rack k in zone k % zones."""
    rng = np.random.default_rng(seed)
    weights, domains = {}, {}
    for h in range(hosts):
        rack = h // hosts_per_rack
        for i in range(per_host):
            node = f"h{h}-n{i}"
            weights[node] = float(rng.choice(WEIGHTS))
            domains[node] = (f"z{rack % zones}", f"r{rack}", f"h{h}")
    return weights, domains


def simulate_domains(num_keys: int, batch: int, seed: int) -> dict[str, Any]:
    weights, domains = labelled_nodes(100, 10, 10, 3, seed)
    t0 = time.perf_counter()
    base = Ring(weights, width=COPIES, domains=domains)
    build_s = time.perf_counter() - t0
    # a new host of 10 nodes in rack r5; one node more on host h7
    new_host = {f"h100-n{i}": float(WEIGHTS[i % 3]) for i in range(10)}
    new_node = {"h7-n10": 1.0}
    extra = {**new_host, **new_node}
    extra_domains = {n: ("z2", "r5", "h100") for n in new_host} | {"h7-n10": domains["h7-n0"]}

    def without(test: Any) -> Ring:
        kept = [n for n in weights if not test(domains[n])]
        return Ring({n: weights[n] for n in kept}, width=COPIES,
                    domains={n: domains[n] for n in kept})

    def plus(added: dict[str, float]) -> Ring:
        return Ring({**weights, **added}, width=COPIES,
                    domains={**domains, **{n: extra_domains[n] for n in added}})

    moved_domains = {n: ("z2", "r5", "h37") if d[2] == "h37" else d for n, d in domains.items()}
    changes = {
        "host h37 moves from rack r3 (zone z0) to rack r5 (zone z2)":
            Ring(weights, width=COPIES, domains=moved_domains),
        "host h37 leaves": without(lambda d: d[2] == "h37"),
        "rack r4 leaves": without(lambda d: d[1] == "r4"),
        "zone z1 leaves": without(lambda d: d[0] == "z1"),
        "host h100 (10 nodes) joins rack r5": plus(new_host),
        "node h7-n10 joins host h7": plus(new_node),
    }
    universe = {name: i for i, name in enumerate([*base.nodes, *extra])}
    index = {id(r): np.array([universe[x] for x in r.nodes]) for r in (base, *changes.values())}
    leavers = {name: np.array([universe[n] for n in base.nodes if n not in r.weights])
               for name, r in changes.items()}
    joiners = {name: np.array([universe[n] for n in r.nodes if n not in base.weights])
               for name, r in changes.items()}
    levels = level_ids({**domains, **extra_domains}, universe)
    # the move: a key whose copies share a zone, rack or host under the new labels must
    # change one of them, and each copy the host holds after and not before arrived
    relabelled = level_ids({**moved_domains, **extra_domains}, universe)
    moved_name = next(iter(changes))
    moving = np.array([universe[n] for n, d in domains.items() if d[2] == "h37"])
    counts = np.zeros(len(universe), dtype=np.int64)
    shared = np.zeros(3, dtype=np.int64)  # keys with two copies on one zone, rack, host
    moved = dict.fromkeys(changes, 0)
    minimum = dict.fromkeys(changes, 0)
    for positions in stream(num_keys, batch, seed + 1):
        old = index[id(base)][base.owner_indexes(positions, COPIES)]
        counts += np.bincount(old.ravel(), minlength=len(universe))
        for level in range(3):
            shared[level] += int(shares_a_domain(old, levels[level : level + 1]).sum())
        for name, ring in changes.items():
            new = index[id(ring)][ring.owner_indexes(positions, COPIES)]
            fresh = (new[:, :, None] != old[:, None, :]).all(axis=2)  # not in its row before
            moved[name] += int(fresh.sum())
            if name == moved_name:
                arrived = np.isin(new, moving) & fresh
                minimum[name] += int(arrived.sum()) + int(shares_a_domain(old, relabelled).sum())
            else:
                minimum[name] += int(np.isin(old, leavers[name]).sum()
                                     + np.isin(new, joiners[name]).sum())
    w = np.array([weights[n] for n in base.nodes])
    per_weight = counts[: len(base.nodes)] / w
    zone_of = levels[0][: len(base.nodes)]
    zones = []  # what the rule forces (a zone holds 1/3 of the copies whatever its size),
    for z in range(3):  # then how evenly each zone spreads its share by weight
        mine = zone_of == z
        zones.append({"zone": f"z{z}", "weight_share": float(w[mine].sum() / w.sum()),
                      "copy_share": float(counts[: len(base.nodes)][mine].sum() / counts.sum()),
                      "max_over_mean": float(per_weight[mine].max() / per_weight[mine].mean()),
                      "min_over_mean": float(per_weight[mine].min() / per_weight[mine].mean())})
    return {
        "nodes": len(weights), "hosts": 100, "racks": 10, "zones": 3, "copies": COPIES,
        "keys": num_keys, "build_s": build_s,
        "keys_two_copies_one_zone": int(shared[0]), "keys_two_copies_one_rack": int(shared[1]),
        "keys_two_copies_one_host": int(shared[2]),
        "balance_max_over_mean": float(per_weight.max() / per_weight.mean()),
        "balance_min_over_mean": float(per_weight.min() / per_weight.mean()),
        "balance_exact": exact_balance(base, weights, COPIES),
        "zones_balance": zones,
        "balance_equal_zones": equal_zones_balance(num_keys, batch, seed),
        "changes": [{"change": name, "moved": moved[name], "minimum": minimum[name],
                     "ratio": moved[name] / minimum[name]} for name in changes],
    }


def equal_zones_balance(num_keys: int, batch: int, seed: int) -> tuple[float, ...]:
    """Load max/mean (and min/mean) by weight when each zone has the same total weight:
    the same nodes, every weight of a zone scaled by (total / zones) / the zone's total;
    from the keys, then exact (:func:`exact_balance`)."""
    weights, domains = labelled_nodes(100, 10, 10, 3, seed)
    zone_total: dict[str, float] = {}
    for node, weight in weights.items():
        zone_total[domains[node][0]] = zone_total.get(domains[node][0], 0.0) + weight
    fair = sum(weights.values()) / len(zone_total)
    scaled = {n: w * fair / zone_total[domains[n][0]] for n, w in weights.items()}
    ring = Ring(scaled, width=COPIES, domains=domains)
    counts = np.zeros(len(ring.nodes), dtype=np.int64)
    for positions in stream(num_keys, batch, seed + 1):
        counts += np.bincount(ring.owner_indexes(positions, COPIES).ravel(),
                              minlength=len(ring.nodes))
    per_weight = counts / np.array([scaled[n] for n in ring.nodes])
    return (float(per_weight.max() / per_weight.mean()),
            float(per_weight.min() / per_weight.mean()), *exact_balance(ring, scaled, COPIES))


def exact_balance(ring: Ring, weights: dict[str, float], r: int) -> tuple[float, float]:
    """Load max/mean (and min/mean) by weight from the ring's arcs, not from keys: each
    point takes the arc of the key space that ends at it, and its ``r`` owners hold a copy
    of every key there. What infinitely many keys would give: the placement's own
    balance, without the few percent that sampling 10M keys adds to the most loaded of
    1,000 nodes."""
    positions = ring.positions
    arcs = np.empty(len(positions), dtype=np.float64)
    arcs[1:] = np.diff(positions).astype(np.float64)
    arcs[0] = float(positions[0]) + (2.0**64 - float(positions[-1]))  # wraps past 2**64
    owners = ring.owner_indexes(positions, r)  # a key at a point is that point's
    load = np.zeros(len(ring.nodes))
    for column in range(r):
        load += np.bincount(owners[:, column], weights=arcs, minlength=len(ring.nodes))
    per_weight = load / np.array([weights[n] for n in ring.nodes])
    return float(per_weight.max() / per_weight.mean()), float(per_weight.min() / per_weight.mean())


def level_ids(domains: dict[str, Domain], universe: dict[str, int]) -> list[Any]:
    """Each node's zone, rack and host as small integers, in ``universe``'s order (a rack
    is named within its zone and a host within its rack: ids go to the paths)."""
    out = []
    for level in range(3):
        paths = {p: i for i, p in enumerate(sorted({d[: level + 1] for d in domains.values()}))}
        out.append(np.array([paths[domains[n][: level + 1]] for n in universe]))
    return out


def shares_a_domain(owners: Any, levels: list[Any]) -> Any:
    """For each row of owners: whether two of them share a domain at any of ``levels``."""
    hit = np.zeros(len(owners), dtype=bool)
    for ids in levels:
        row = np.sort(ids[owners], axis=1)
        hit |= (row[:, 1:] == row[:, :-1]).any(axis=1)
    return hit


def domains_table(r: dict[str, Any]) -> str:
    out = [f"{r['nodes']} nodes, {r['hosts']} hosts, {r['racks']} racks, {r['zones']} zones, "
           f"{r['copies']} copies, {r['keys'] / 1e6:.0f}M keys; ring built in "
           f"{r['build_s']:.1f} s",
           "",
           "| keys with two copies on one host / rack / zone | load max/mean (min): keys "
           "| exact (the ring's arcs) |",
           "|---|---|---|",
           f"| {r['keys_two_copies_one_host']} / {r['keys_two_copies_one_rack']} / "
           f"{r['keys_two_copies_one_zone']} | {r['balance_max_over_mean']:.3f} "
           f"({r['balance_min_over_mean']:.3f}) | {r['balance_exact'][0]:.3f} "
           f"({r['balance_exact'][1]:.3f}) |",
           "",
           f"Zones of equal weight (each zone's weights scaled to a third of the total): load "
           f"max/mean {r['balance_equal_zones'][0]:.3f} (min {r['balance_equal_zones'][1]:.3f}) "
           f"from the keys, {r['balance_equal_zones'][2]:.3f} "
           f"(min {r['balance_equal_zones'][3]:.3f}) exact",
           "",
           "| zone | share of the weight | share of the copies | load max/mean in the zone "
           "(min) |",
           "|---|---|---|---|",
           *(f"| {z['zone']} | {z['weight_share']:.3f} | {z['copy_share']:.3f} | "
             f"{z['max_over_mean']:.3f} ({z['min_over_mean']:.3f}) |" for z in r["zones_balance"]),
           "",
           "| change | copies moved | minimum | moved ÷ minimum |",
           "|---|---|---|---|"]
    for c in r["changes"]:
        out.append(f"| {c['change']} | {c['moved']:,} | {c['minimum']:,} | {c['ratio']:.3f}x |")
    return "\n".join(out)


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| nodes | points | keys | balance max/mean (min): keys; exact | moved on join ÷ ideal "
           "| moved on leave ÷ ideal | strays | ring memory | build | owners(512 keys, r=3) "
           "| owners(1 key) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['nodes']} | {r['points']:,} | {r['keys'] / 1e6:.0f}M "
            f"| {r['balance_max_over_mean']:.3f} ({r['balance_min_over_mean']:.3f}); "
            f"{r['balance_exact'][0]:.3f} ({r['balance_exact'][1]:.3f}) "
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
    parser.add_argument("--no-domains", dest="domains", action="store_false",
                        help="leave out the failure-domain simulation (~1 min a million keys)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/placement_sim.json"))
    args = parser.parse_args()
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        rows.append(simulate(n, int(args.keys), args.batch, args.seed))
        print(f"  {n} nodes done", flush=True)
    print(table(rows))
    domains = simulate_domains(int(args.keys), args.batch, args.seed) if args.domains else None
    if domains is not None:
        print()
        print(domains_table(domains))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rings": rows, "domains": domains}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
