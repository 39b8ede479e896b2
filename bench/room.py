"""Room for a large value in a DRAM tier full of small ones: LRU order alone vs by place.

    python -m bench.room [--capacity-mib 64] [--runs 3]

For each size of the small values and of the large one: a fresh tier of
``--capacity-mib`` filled with the small values, half of them read in random order
(LRU order then has nothing to do with where values lie), then one reservation of
the large value. "LRU only" evicts least recently used entries until an extent big
enough forms (what the tier did before ``tiers/room.py``: the bound set out of
reach); "bounded" is the tier as it is: LRU victims up to the value's own extent,
then a hole by place. Prints MiB evicted and the reservation's time (median
[min-max] of ``--runs``) and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

from bench._stats import fmt, save, summary
from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE, seal
from kvpool.tiers import room
from kvpool.tiers.dram import DramTier

MiB = 1 << 20
SMALL = (4 << 10, 64 << 10, 256 << 10)
LARGE = (1 << 20, 4 << 20, 16 << 20)


def one(capacity: int, small: int, large: int, *, lru_only: bool, seed: int
        ) -> tuple[float, float]:
    """MiB evicted and milliseconds taken by one reservation of ``large``."""
    payload = os.urandom(small - ENVELOPE_HEADER_SIZE)
    value = seal(payload) + payload
    bound = room.LRU_BOUND
    if lru_only:
        room.LRU_BOUND = 1 << 40  # never stops before a hole forms
    try:
        tier = DramTier(capacity)
        keys = [i.to_bytes(16, "big") for i in range(capacity // small)]
        for key in keys:
            tier.put(key, value)
        for key in random.Random(seed).sample(keys, len(keys) // 2):
            tier.get(key)
        before = tier.stats().evictions
        started = time.perf_counter()
        slot = tier.reserve(os.urandom(16), large)
        took = time.perf_counter() - started
        if slot is None:
            raise RuntimeError(f"no room for {large} bytes")
        slot.release()
        return (tier.stats().evictions - before) * small / MiB, took * 1e3
    finally:
        room.LRU_BOUND = bound


def run(args: argparse.Namespace) -> dict[str, Any]:
    capacity = args.capacity_mib * MiB
    rows = []
    for small in SMALL:
        for large in LARGE:
            if large <= small:
                continue
            got: dict[str, dict[str, list[float]]] = {}
            for r in range(args.runs):
                for name in ("lru only", "bounded") if r % 2 == 0 else ("bounded", "lru only"):
                    mib, ms = one(capacity, small, large, lru_only=name == "lru only", seed=r)
                    series = got.setdefault(name, {"mib": [], "ms": []})
                    series["mib"].append(mib)
                    series["ms"].append(ms)
            rows.append({"small": small, "large": large,
                         **{name: {k: summary(v) for k, v in s.items()}
                            for name, s in got.items()},
                         "evicted_ratio": statistics.median(
                             b / a for a, b in zip(got["lru only"]["mib"],
                                                   got["bounded"]["mib"], strict=True))})
    return {"capacity_mib": args.capacity_mib, "runs": args.runs, "rows": rows}


def report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(f"one large reservation in a full {result['capacity_mib']} MiB "
                               f"tier of small values, median [min-max] of {result['runs']}"))
    for col in ("small", "large", "evicted MiB, LRU only", "bounded", "bounded / LRU",
                "ms, LRU only", "bounded"):
        table.add_column(col, justify="right")
    for row in result["rows"]:
        table.add_row(f"{row['small'] >> 10} KiB", f"{row['large'] >> 20} MiB",
                      fmt(row["lru only"]["mib"]), fmt(row["bounded"]["mib"]),
                      f"{row['evicted_ratio']:.3f}x", fmt(row["lru only"]["ms"]),
                      fmt(row["bounded"]["ms"]))
    Console(width=160).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity-mib", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    result = run(args)
    report(result)
    print(f"wrote {save('room', result)}")


if __name__ == "__main__":
    main()
