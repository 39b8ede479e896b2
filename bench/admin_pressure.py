"""What the admin side costs the data path under attack (issue 47's two measurements).

    python -m bench.admin_pressure [--rounds 3] [--seconds 5]

One DRAM node on 127.0.0.1; a client writes 4 KiB values (``put_many`` of 64) as
fast as it can, in rounds that alternate between quiet and attacked, so the noise of
a shared machine falls on both alike:

- **subscribers**: 100 ``/v1/events`` streams that never read, opened before the
  round (the node drops each once it is 10,000 events behind). Before the fix they
  cut the PUT rate to 0.16x; the target is >= 0.9x.
- **subscribers_reconnecting**: the same, each opened again as soon as the node drops
  it (an attacker who keeps at it: every second, 100 new requests to serve).
- **flood**: the node's descriptor limit set to twice ``--max-connections`` (64 of
  each, so 128), then 10,192 connections to its admin port that never send a byte,
  kept open (reopened as closed). Before the fix they took every descriptor and the
  node closed a tenant's data connection at once. Measured: the PUT rate against a
  quiet round, and 50 fresh data connections opened during the flood, each one PUT
  and GET (all must work).

Prints a table and writes ``bench/results/admin_pressure.json``: per kind, the PUT
rate quiet and attacked (median [min-max] over rounds) and their ratio per round pair.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import threading
import time
from typing import Any

from bench._attacks import AdminFlood, SilentSubscribers
from bench._procs import Proc, start_node
from bench._stats import fmt, save, summary
from kvpool.client import Client

VALUE = os.urandom(4096)
BATCH = 64


def put_rate(url: str, seconds: float) -> float:
    """4 KiB values written per second by one client for ``seconds``."""
    with Client(url, shm=False) as kv:
        done = 0
        started = time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            keys = [os.urandom(16) for _ in range(BATCH)]
            kv.put_many(keys, [VALUE] * BATCH)
            done += BATCH
        return done / elapsed


def fresh_connections(url: str, count: int) -> int:
    """How many of ``count`` new data connections could PUT and GET."""
    worked = 0
    for i in range(count):
        try:
            with Client(url, shm=False, timeout=10) as kv:
                key = os.urandom(16)
                kv.put(key, b"fresh %d" % i)
                got = kv.get(key)
                worked += got is not None and bytes(got) == b"fresh %d" % i
        except Exception:  # counted as not working; the figure is the count
            continue
    return worked


def measure(node: Proc, attack: Any, rounds: int, seconds: float,
            during: Any = None) -> dict[str, Any]:
    quiet: list[float] = []
    attacked: list[float] = []
    extra: list[Any] = []
    for _ in range(rounds):
        quiet.append(put_rate(node.url, seconds))
        stop = threading.Event()
        thread = attack(stop)
        thread.start()
        time.sleep(1.0)  # the attack in place before the round
        ready = getattr(thread, "ready", None)
        if ready is not None:
            ready.wait(120)  # the flood opened what it could
        attacked.append(put_rate(node.url, seconds))
        if during is not None:
            extra.append(during())
        stop.set()
        thread.join(30)
        time.sleep(0.5)
    ratios = [a / q for a, q in zip(attacked, quiet, strict=True)]
    return {"quiet_puts_per_s": summary(quiet), "attacked_puts_per_s": summary(attacked),
            "ratio": summary(ratios), "ratios": ratios, "attacker": thread.summary(),
            "during": extra}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--subscribers", type=int, default=100)
    parser.add_argument("--flood", type=int, default=10_192)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.flood + 1024
    if soft < need:  # this process holds the flood's sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    results: dict[str, Any] = {}

    node = start_node("--dram-capacity", "1GiB", "--no-ssd")
    try:
        for name, again in (("subscribers", False), ("subscribers_reconnecting", True)):
            results[name] = measure(
                node, lambda stop, again=again: SilentSubscribers(
                    [node.admin_url], stop, per_node=args.subscribers, reconnect=again),
                args.rounds, args.seconds)
            with Client(node.url) as kv:
                results[name]["node_events"] = kv.stats()["events"]
    finally:
        node.stop()

    node = start_node("--dram-capacity", "1GiB", "--no-ssd", "--max-connections", "64",
                      "--admin-max-connections", "64")
    try:
        resource.prlimit(node.proc.pid, resource.RLIMIT_NOFILE, (128, 128))
        results["flood"] = measure(
            node, lambda stop: AdminFlood([node.admin_url], stop, per_node=args.flood),
            args.rounds, args.seconds, during=lambda: fresh_connections(node.url, 50))
        results["flood"]["fresh_data_connections"] = {"tried_per_round": 50,
                                                      "worked": results["flood"]["during"]}
    finally:
        node.stop()

    print("\n| attack | PUTs/s quiet | PUTs/s attacked | attacked / quiet | attacker |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {fmt(r['quiet_puts_per_s'])} | {fmt(r['attacked_puts_per_s'])} "
              f"| {fmt(r['ratio'], 'x')} | {r['attacker']} |")
    worked = results["flood"]["during"]
    print(f"\nfresh data connections during the flood: {worked} of 50 per round")
    out = save("admin_pressure", {"rounds": args.rounds, "seconds": args.seconds,
                                  "subscribers": args.subscribers, "flood": args.flood,
                                  **results})
    print(f"written to {out}")
    ok = statistics.median(results["subscribers"]["ratios"]) >= 0.9 and \
        all(w == 50 for w in worked)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
