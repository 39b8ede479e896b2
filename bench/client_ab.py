"""The SDK's small calls, this checkout against another one, in one run.

    python -m bench.client_ab --before ../old-checkout            # one node
    python -m bench.client_ab --before ../old --cluster 3 --pin   # 3 nodes, 1 CPU
    python -m bench.client_ab --before ../old --vary nodes        # the node's code
    python -m bench.client_ab --before ../old --puts              # 1 MiB puts, same host

``--before`` is another kvpool checkout (``git worktree add ../old <commit>``). The
node processes run this checkout's code; each round runs the client once with the
other checkout's SDK and once with this one's, in turn, so that machine noise hits both
alike (rounds alternate which goes first). ``--vary nodes`` turns it around: two sets
of nodes, one running each checkout's code, and this checkout's client against each in
turn (what a change to the node does to the same calls). Series, over TCP (``shm=False``): a sync
``get`` of 4 KiB (the blocking socket), a sync ``exists``, a sync ``lookup`` of 512 keys
(half of them held: what an engine's scheduler asks), an async ``get`` of 4 KiB and an
async ``lookup`` of 512 keys. Per series it prints p50 and
p99 (median [min-max] over rounds), the client's CPU a call (user and system,
``getrusage``), and the median of the per-round ratios after/before. ``--puts`` times
1 MiB puts instead, through the same-host arena (nodes with the fast path; sync, sync
8 a call, async, async with 4 in flight) and over TCP (one a call, 8 a call). ``--pin`` puts
the nodes and the client on CPU 0 (what the client's own work costs shows most
there). Writes ``bench/results/client_ab.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench._stats import fmt, save, summary
from kvpool.cli.local_cluster import LocalCluster

CHECKOUT = Path(__file__).resolve().parent.parent

#: one client run: prints {series: {"p50", "p99", "user", "sys"}} as JSON (seconds)
_CLIENT = r"""
import asyncio, json, os, resource, sys, time
from kvpool.client import AsyncClient, Client
url, n = sys.argv[1], int(sys.argv[2])
out = {}
def timed(name, calls):
    ts = []
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(n):
        t = time.perf_counter(); calls(); ts.append(time.perf_counter() - t)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    ts.sort()
    out[name] = {"p50": ts[n // 2], "p99": ts[int(n * 0.99)],
                 "user": (r1.ru_utime - r0.ru_utime) / n, "sys": (r1.ru_stime - r0.ru_stime) / n}
with Client(url, shm=False) as c:
    key = os.urandom(16)
    c.put(key, b"x" * 4096)
    held = [os.urandom(16) for _ in range(512)]
    c.put_many(held[:256], [b"y" * 100] * 256)
    for name, call in (("sync get 4 KiB", lambda: c.get(key)),
                       ("sync exists", lambda: c.exists(key)),
                       ("sync lookup 512", lambda: c.lookup(held))):
        for _ in range(200):
            call()
        timed(name, call)
async def run_async():
    async with AsyncClient(url, shm=False) as c:
        keys = [os.urandom(16) for _ in range(512)]
        await c.put_many(keys[:256], [b"y" * 100] * 256)
        loop = asyncio.get_running_loop()
        for name, make in (("async get 4 KiB", lambda: c.get(keys[0])),
                           ("async lookup 512", lambda: c.lookup(keys))):
            for _ in range(100):
                await make()
            ts = []
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            for _ in range(n):
                t = time.perf_counter(); await make(); ts.append(time.perf_counter() - t)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            ts.sort()
            out[name] = {"p50": ts[n // 2], "p99": ts[int(n * 0.99)],
                         "user": (r1.ru_utime - r0.ru_utime) / n,
                         "sys": (r1.ru_stime - r0.ru_stime) / n}
asyncio.run(run_async())
print(json.dumps(out))
"""


#: ``--puts``: 1 MiB puts to the same host (the arena, ``shm=True``) and over TCP; 64
#: values put in turn; "4 in flight" times a gather of 4 puts
_PUT_CLIENT = r"""
import asyncio, json, os, resource, sys, time
from kvpool.client import AsyncClient, Client
url, n = sys.argv[1], int(sys.argv[2])
out = {}
keys = [os.urandom(16) for _ in range(64)]
values = [os.urandom(1 << 20) for _ in range(64)]
turn = [0]
def pair():
    turn[0] = (turn[0] + 1) % 64
    return keys[turn[0]], values[turn[0]]
def record(name, ts, r0, r1):
    ts.sort()
    k = len(ts)
    out[name] = {"p50": ts[k // 2], "p99": ts[int(k * 0.99)],
                 "user": (r1.ru_utime - r0.ru_utime) / k, "sys": (r1.ru_stime - r0.ru_stime) / k}
def eight():
    got = [pair() for _ in range(8)]
    return [k for k, _ in got], [v for _, v in got]
for name, shm, batch in (("sync shm put 1 MiB", True, False), ("sync put 1 MiB, TCP", False, False),
                         ("sync shm put_many 8 x 1 MiB", True, True),
                         ("sync put_many 8 x 1 MiB, TCP", False, True)):
    with Client(url, shm=shm) as c:
        for _ in range(64):
            c.put(*pair())
        ts = []
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(max(50, n // 8) if batch else n):
            t = time.perf_counter()
            c.put_many(*eight()) if batch else c.put(*pair())
            ts.append(time.perf_counter() - t)
        record(name, ts, r0, resource.getrusage(resource.RUSAGE_SELF))
async def run_async():
    async with AsyncClient(url, shm=True) as c:
        for name, depth in (("async shm put 1 MiB", 1), ("async shm put 1 MiB, 4 in flight", 4)):
            for _ in range(16):
                await asyncio.gather(*(c.put(*pair()) for _ in range(depth)))
            ts = []
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            for _ in range(n):
                t = time.perf_counter()
                await asyncio.gather(*(c.put(*pair()) for _ in range(depth)))
                ts.append(time.perf_counter() - t)
            record(name, ts, r0, resource.getrusage(resource.RUSAGE_SELF))
asyncio.run(run_async())
print(json.dumps(out))
"""


def _start(stack: contextlib.ExitStack, nodes: int, data_dir: Path, pin: bool,
           shim: Path | None, *, shm: bool = False) -> str:
    """Start ``nodes`` DRAM-only nodes (running ``shim``'s checkout, else this one's) for
    the rest of ``stack``, with the same-host fast path if ``shm``; their URL."""
    saved = os.environ.get("PYTHONPATH")
    if shim is not None:  # the node processes inherit it
        os.environ["PYTHONPATH"] = str(shim)
    try:
        cluster = stack.enter_context(LocalCluster(
            nodes, replication=min(2, nodes), data_dir=data_dir,
            serve_args=["--no-ssd", *([] if shm else ["--no-shm"])], standalone=nodes == 1))
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    if pin:
        _pin(cluster)
    return "kvpool://" + ",".join(seed.removeprefix("kvpool://") for seed in cluster.seeds)


def _shim(checkout: Path, into: Path) -> Path:
    """A directory whose ``kvpool`` is ``checkout`` (put first on PYTHONPATH, it wins
    over the installed package)."""
    into.mkdir()
    (into / "kvpool").symlink_to(checkout.resolve(), target_is_directory=True)
    return into


def _client(shim: Path, url: str, calls: int, pin: bool, script: str = _CLIENT
            ) -> dict[str, dict[str, float]]:
    cmd = [sys.executable, "-c", script, url, str(calls)]
    if pin:
        cmd = ["taskset", "-c", "0", *cmd]
    env = {**os.environ, "PYTHONPATH": str(shim)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    if done.returncode:
        raise RuntimeError(f"client run failed: {done.stderr[-2000:]}")
    result: dict[str, dict[str, float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _pin(cluster: LocalCluster) -> None:
    """Every node process (and its threads) on CPU 0."""
    for node in cluster.nodes:
        if node.proc is not None:
            subprocess.run(["taskset", "-a", "-p", "-c", "0", str(node.proc.pid)],
                           capture_output=True, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, type=Path,
                        help="the other kvpool checkout (the baseline)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=3000, help="calls a series a round")
    parser.add_argument("--cluster", type=int, default=1, help="nodes (1: standalone)")
    parser.add_argument("--pin", action="store_true", help="everything on CPU 0")
    parser.add_argument("--vary", choices=("client", "nodes"), default="client",
                        help="which side runs the other checkout's code (default: client)")
    parser.add_argument("--puts", action="store_true",
                        help="1 MiB puts instead: through the same-host arena (sync, sync 8 a "
                             "call, async, 4 in flight) and over TCP (sync, 8 a call)")
    args = parser.parse_args(argv)
    script = _PUT_CLIENT if args.puts else _CLIENT
    if not (args.before / "client" / "_async.py").exists():
        parser.error(f"--before {args.before} is not a kvpool checkout")
    runs: dict[str, list[dict[str, dict[str, float]]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        shims = {"before": _shim(args.before, Path(tmp, "before")),
                 "after": _shim(CHECKOUT, Path(tmp, "after"))}
        sides = ("before", "after") if args.vary == "nodes" else ("this",)
        urls = {side: _start(stack, args.cluster, Path(tmp, f"nodes-{side}"), args.pin,
                             shims.get(side), shm=args.puts) for side in sides}
        for r in range(args.rounds):
            for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
                if args.vary == "nodes":
                    runs[side].append(_client(shims["after"], urls[side], args.calls, args.pin,
                                              script))
                else:
                    runs[side].append(_client(shims[side], urls["this"], args.calls, args.pin,
                                              script))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    table: dict[str, Any] = {}
    print(f"\n{args.cluster} node(s), {'all on CPU 0' if args.pin else 'as scheduled'}, "
          f"{'the nodes' if args.vary == 'nodes' else 'the client'} before and after, "
          f"{args.rounds} rounds x {args.calls} calls; ms, median [min-max] over rounds\n")
    print("| series | p50 before | p50 after | after/before | p99 before | p99 after "
          "| client CPU before (user+sys) | after |")
    print("|---|---|---|---|---|---|---|---|")
    for series in runs["before"][0]:
        row: dict[str, Any] = {}
        for key in ("p50", "p99"):
            for side in ("before", "after"):
                row[f"{key} {side}"] = summary([run[series][key] for run in runs[side]])
        for side in ("before", "after"):
            row[f"cpu {side}"] = summary([run[series]["user"] + run[series]["sys"]
                                          for run in runs[side]])
        row["ratio"] = summary([a[series]["p50"] / b[series]["p50"]
                                for a, b in zip(runs["after"], runs["before"], strict=True)])
        table[series] = row
        print(f"| {series} | {fmt(row['p50 before'], scale=1e3)} | "
              f"{fmt(row['p50 after'], scale=1e3)} | {fmt(row['ratio'], 'x')} | "
              f"{fmt(row['p99 before'], scale=1e3)} | {fmt(row['p99 after'], scale=1e3)} | "
              f"{fmt(row['cpu before'], scale=1e3)} | {fmt(row['cpu after'], scale=1e3)} |")
    out = save("client_ab", {"before": str(args.before.resolve()), "nodes": args.cluster,
                             "vary": args.vary, "puts": args.puts,
                             "pin": args.pin, "rounds": args.rounds, "calls": args.calls,
                             "series": table, "runs": runs})
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
