"""Small GETs with many requests in flight: kvpool's AsyncClient against Redis's.

    python -m bench.concurrency                 # 5 runs, 1/8/32 in flight
    python -m bench.concurrency --quick         # smoke run

Starts a DRAM-only kvpool node (``--no-ssd``) and ``redis-server`` on 127.0.0.1 and
stores ``--keys`` values of ``--size`` bytes in both. Each run then times ``--ops``
GETs through each client with N requests in flight: N tasks on one uvloop event
loop, each awaiting its GETs one after another. kvpool's ``AsyncClient`` (TCP, no
shared memory, its default pool of connections, on which requests are pipelined)
against ``redis.asyncio`` with hiredis (its default pool: a connection per request
in flight). The series of a run are taken in turn, the order rotated from run to
run. Prints ops/s, median [min-max] over runs, and kvpool / Redis paired by run;
writes JSON. The issue's target (#24): with 32 in flight, kvpool >= Redis.

Every client's first GET is checked against the value stored.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench._procs import Proc, start_node, start_redis
from bench._stats import fmt, save, summary
from kvpool.client import AsyncClient

Get = Callable[[bytes], Awaitable[Any]]


async def drive(get: Get, keys: list[bytes], ops: int, inflight: int) -> float:
    """``ops`` GETs, ``inflight`` at a time; ops/s."""
    async def worker(first: int) -> None:
        for i in range(first, ops, inflight):
            await get(keys[i % len(keys)])

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(inflight)))
    return ops / (time.perf_counter() - started)


async def measure(node: Proc, redis_port: int, args: argparse.Namespace) -> dict[str, Any]:
    import redis.asyncio as aioredis

    keys = [os.urandom(16) for _ in range(args.keys)]
    values = [os.urandom(args.size) for _ in keys]
    rds = aioredis.Redis(host="127.0.0.1", port=redis_port)
    async with AsyncClient(node.url, shm=False) as kv:
        await kv.put_many(keys, values)
        for key, value in zip(keys, values, strict=True):
            await rds.set(key, value)
        got: list[Any] = [await kv.get(keys[0]), await rds.get(keys[0])]
        if any(value is None or bytes(value) != values[0] for value in got):
            raise RuntimeError("a GET did not return the value stored")
        clients: dict[str, Get] = {"kvpool": kv.get, "redis": rds.get}
        await drive(kv.get, keys, 200, 8)  # warm: connections open, caches hot
        await drive(rds.get, keys, 200, 8)
        samples: dict[str, dict[int, list[float]]] = {
            name: {n: [] for n in args.inflight} for name in clients}
        for run in range(args.runs):
            for n in args.inflight:
                names = list(clients)
                names = names[run % 2:] + names[: run % 2]  # who goes first alternates
                for name in names:
                    samples[name][n].append(await drive(clients[name], keys, args.ops, n))
            print(f"  run {run + 1}/{args.runs} done", flush=True)
    await rds.aclose()
    rows = []
    for n in args.inflight:
        ratio = [a / b for a, b in zip(samples["kvpool"][n], samples["redis"][n], strict=True)]
        rows.append({"inflight": n, "kvpool_ops_s": summary(samples["kvpool"][n]),
                     "redis_ops_s": summary(samples["redis"][n]),
                     "kvpool_over_redis": summary(ratio),
                     "samples": {name: samples[name][n] for name in samples}})
    return {"size": args.size, "ops": args.ops, "runs": args.runs, "rows": rows}


def _ops(s: dict[str, float]) -> str:
    return f"{s['median']:,.0f} [{s['min']:,.0f}-{s['max']:,.0f}]"


def report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(f"GETs of {result['size']} B with N in flight (ops/s, "
                               f"median [min-max] of {result['runs']} runs of "
                               f"{result['ops']} GETs)"))
    for col in ("in flight", "kvpool AsyncClient", "Redis (redis.asyncio)", "kvpool / Redis"):
        table.add_column(col, justify="right")
    for row in result["rows"]:
        table.add_row(str(row["inflight"]), _ops(row["kvpool_ops_s"]), _ops(row["redis_ops_s"]),
                      fmt(row["kvpool_over_redis"], "x"))
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--ops", type=int, default=4000, help="GETs a series a run")
    parser.add_argument("--size", type=int, default=4096, help="value bytes")
    parser.add_argument("--keys", type=int, default=1024)
    parser.add_argument("--inflight", default="1,8,32",
                        help="requests in flight, comma-separated (default: 1,8,32)")
    parser.add_argument("--quick", action="store_true", help="2 runs of 500 GETs")
    args = parser.parse_args()
    args.inflight = [int(n) for n in args.inflight.split(",")]
    if args.quick:
        args.runs, args.ops = 2, 500
    redis_proc = start_redis()
    if redis_proc is None:
        raise SystemExit("redis-server is not installed (apt install redis-server)")
    node = start_node("--no-ssd", "--dram-capacity", "256MiB")
    try:
        import uvloop

        result = uvloop.run(measure(node, redis_proc.port, args))
    finally:
        node.stop()
        redis_proc.stop()
    report(result)
    print(f"wrote {save('concurrency', result)}")


if __name__ == "__main__":
    main()
