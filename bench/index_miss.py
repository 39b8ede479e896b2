"""Same-host GETs the arena index cannot answer: a miss, and a value the index has no slot
for, from the sync client in its own thread (over TCP) beside the same GETs on the
client's event loop (GET_SHM under a lease, the path before), with a hit through the index
for scale.

    python -m bench.index_miss [--samples 2000] [--rounds 5]

The index has one slot per 32 KiB of arena in sets of 8: a set filled by eight values
lacks the ninth (a tier of values smaller than 32 KiB, or keys that collide). p50 / p99
in microseconds, the series taking turns in rounds; writes bench/results/index_miss.json.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from typing import Any

from bench._procs import start_node
from bench._stats import save
from bench.throughput import interleaved
from kvpool.client import Client
from kvpool.protocol.shm_index import WAYS, index_sets, set_of

CAPACITY = 64 << 20
SIZES = {"4 KiB": 4 << 10, "64 KiB": 64 << 10, "1 MiB": 1 << 20}


def _keys_in_set(target: int, sets: int) -> Iterator[bytes]:
    while True:
        key = os.urandom(16)
        if set_of(key, sets) == target:
            yield key


def _get(client: Client, key: bytes) -> Callable[[], object]:
    return lambda: client.get(key)


def measure(samples: int, rounds: int) -> dict[str, Any]:
    node = start_node("--dram-capacity", str(CAPACITY), "--no-ssd")
    sets = index_sets(CAPACITY)
    try:
        with Client(node.url, pool_size=1) as own, \
                Client(node.url, pool_size=1, blocking=False) as looped:
            series: dict[str, Callable[[], object]] = {}
            hit = os.urandom(16)
            own.put(hit, os.urandom(SIZES["4 KiB"]))
            missing = os.urandom(16)
            series["hit through the index (4 KiB)"] = _get(own, hit)
            series["miss, own thread (TCP)"] = _get(own, missing)
            series["miss, on the loop (GET_SHM)"] = _get(looped, missing)
            for n, (label, size) in enumerate(SIZES.items(), start=1):
                keys = _keys_in_set(n, sets)
                for _ in range(WAYS):  # the set full: the next value has no slot
                    own.put(next(keys), os.urandom(4096))
                lacked = next(keys)
                value = os.urandom(size)
                own.put(lacked, value)
                for client in (own, looped):
                    got = client.get(lacked)
                    assert got is not None and bytes(got) == value
                series[f"value the index lacks, own thread (TCP, {label})"] = _get(own, lacked)
                series[f"value the index lacks, on the loop (GET_SHM, {label})"] = \
                    _get(looped, lacked)
            full = own.stats()["shm"]["index"]["set_full"]
            us = interleaved(series, samples, rounds, scale=1e6)
    finally:
        node.stop()
    return {"set_full": full, "samples": samples, "rounds": rounds, "us": us}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.index_miss", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2000, help="GETs a series")
    parser.add_argument("--rounds", type=int, default=5, help="turns the series take")
    args = parser.parse_args(argv)
    result = measure(args.samples, args.rounds)
    print(f"same-host GETs the arena index cannot answer (sets found full: "
          f"{result['set_full']}), p50 / p99 us")
    for name, row in result["us"].items():
        print(f"  {name:<55} {row['p50']:8.1f} {row['p99']:8.1f}")
    print(f"wrote {save('index_miss', result)}")


if __name__ == "__main__":
    main()
