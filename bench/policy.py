"""Which chunks a DRAM tier keeps: prefix hit ratio against capacity, each eviction policy
beside the offline optimum and infinite capacity, on request traces.

    python -m bench.policy [TRACE.jsonl ...] [--synthetic N] [--capacities 0.01,0.02,...]
                           [--policies chain,lru] [--tcp 0.01,0.05] [--seed 0]

A trace is JSONL, one request a line: ``hash_ids`` (a list of block ids, Mooncake's
trace format: equal ids at equal positions are the same prefix block) or ``tokens`` (a
list of token ids, cut into 512-token chunks). Keys are chained (each block's key hashes
its parent's key with its id), so a block is its whole prefix, as kvpool's keys are.
Without a trace file, ``--synthetic N`` requests (default 12,000) come from
:func:`synthetic`, a seeded generator with the patterns production traces show.

Each request, as a new user would run it: look up its chunks, read the cached prefix,
store the chunks after it, one chunk a call with its parent (what the engine adapters
do). A chunk is 4 KiB (one arena page), so exactly C chunks fit, C a share of the trace's
distinct chunks. Replayed through the real :class:`~kvpool.tiers.dram.DramTier` (its
arena, ledger and policy) in this process, and with ``--tcp`` through a real node over
TCP (the SDK's ``lookup``, ``get_many``, ``put``). The optimum is Belady's MIN with
bypass (evict, or never admit, the chunk asked for again furthest ahead; at equal
distance the deeper): with uniform chunks it maximises hits, and since a parent is
always asked for no later than its children, what it keeps is prefix-closed, so its
chunk hits are prefix hits.

Prints a table (hit ratio, and its ratio to the optimum) and writes
bench/results/policy.json.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import xxhash

from bench._stats import save
from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE, seal
from kvpool.tiers.dram import DramTier
from kvpool.tiers.eviction import POLICIES

CHUNK_BYTES = 4096  # one arena page: C chunks fit in C pages
TOKENS_PER_CHUNK = 512
CAPACITIES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)

Trace = list[list[bytes]]  # requests, each its chained chunk keys


def chain(ids: Iterable[object]) -> list[bytes]:
    """Chained 16-byte keys for a request's block ids (or token chunks)."""
    keys: list[bytes] = []
    parent = b""
    for block in ids:
        parent = xxhash.xxh3_128_digest(parent + repr(block).encode())
        keys.append(parent)
    return keys


def load(path: Path) -> Trace:
    """A JSONL trace: ``hash_ids`` per line, or ``tokens`` (cut into 512-token chunks)."""
    trace: Trace = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "hash_ids" in row:
                trace.append(chain(row["hash_ids"]))
            elif "tokens" in row:
                tokens = row["tokens"]
                whole = len(tokens) // TOKENS_PER_CHUNK * TOKENS_PER_CHUNK
                trace.append(chain(tuple(tokens[i:i + TOKENS_PER_CHUNK])
                                   for i in range(0, whole, TOKENS_PER_CHUNK)))
            else:
                raise ValueError(f"{path}:{n}: a request needs hash_ids or tokens")
    return trace


def synthetic(n: int, seed: int = 0) -> Trace:
    """``n`` requests with the patterns of production traces, by arrival time (seeded).

    Shaped after Mooncake's public conversation trace (its hash-id structure: one shared
    first block, contexts that later turns re-send with a block or two appended, turns
    thousands of blocks apart, most requests never followed up), plus agents and
    few-shot templates:

    - in front of every request, one shared system-prompt chunk (80% of sessions) or
      one of four few-shot templates (2-4 chunks);
    - conversations and one-off documents (97% of sessions): a first context of 1-60
      chunks (log-normal, median 8); a fifth of them go on for more turns (2.5
      more on average), each re-sending all before it with 1-3 chunks appended, about
      400 s (thousands of chunks of other traffic) apart; 77% of the distinct chunks
      are asked for once (76% in the production trace of issue 50);
    - agents (3%): a tool context of 8-40 chunks re-sent 3-15 times about 20 s apart,
      a chunk of observations appended at half the steps.

    Sessions start about 1.5 a second (about 30 chunks a second).
    """
    rng = random.Random(seed)
    systems = [["sys"]] + [[f"fewshot{s}.{i}" for i in range(rng.randint(2, 4))]
                           for s in range(4)]
    weights = [0.8] + [0.05] * 4
    events: list[tuple[float, int, list[str]]] = []
    made = 0
    t = 0.0
    session = 0
    while made < n:
        t += rng.expovariate(1.5)
        session += 1
        own = f"s{session}"
        body = list(rng.choices(systems, weights)[0])
        at = t
        if rng.random() < 0.97:  # a conversation (a one-off document: no second turn)
            body += [f"{own}.c{i}" for i in range(min(60, max(1, int(rng.lognormvariate(
                math.log(8), 1.0)))))]
            turns = 1 + (int(rng.expovariate(1 / 3.0)) if rng.random() < 0.2 else 0)
            for turn in range(turns):
                events.append((at, len(events), body))
                body = body + [f"{own}.r{turn}.{i}" for i in range(rng.randint(1, 3))]
                at += rng.expovariate(1 / 400.0)
            made += turns
        else:  # an agent
            body += [f"{own}.t{i}" for i in range(rng.randint(8, 40))]
            steps = rng.randint(3, 15)
            for step in range(steps):
                events.append((at, len(events), body))
                if rng.random() < 0.5:
                    body = [*body, f"{own}.o{step}"]
                at += rng.expovariate(1 / 20.0)
            made += steps
    events.sort()
    return [chain(blocks) for _, _, blocks in events[:n]]


def describe(trace: Trace) -> dict[str, Any]:
    seen: dict[bytes, int] = {}
    for keys in trace:
        for key in keys:
            seen[key] = seen.get(key, 0) + 1
    chunks = sum(map(len, trace))
    return {"requests": len(trace), "chunks": chunks, "distinct": len(seen),
            "asked_once": sum(1 for c in seen.values() if c == 1) / max(1, len(seen))}


# -- bounds -------------------------------------------------------------------------------


def infinite(trace: Trace) -> float:
    """Prefix hit ratio with room for every chunk."""
    held: set[bytes] = set()
    hits = total = 0
    for keys in trace:
        total += len(keys)
        n = 0
        while n < len(keys) and keys[n] in held:
            n += 1
        hits += n
        held.update(keys)
    return hits / total


def optimum(trace: Trace, capacity: int) -> float:
    """Belady's MIN with bypass, ``capacity`` chunks: its prefix hit ratio."""
    nxt: list[list[float]] = [[]] * len(trace)
    last: dict[bytes, int] = {}
    for r in range(len(trace) - 1, -1, -1):
        keys = trace[r]
        nxt[r] = [last.get(k, math.inf) for k in keys]
        for k in keys:
            last[k] = r
    held: dict[bytes, float] = {}  # key -> its next use
    heap: list[tuple[float, int, bytes]] = []  # (-next use, -depth, key), stale ones kept
    hits = total = 0
    for r, keys in enumerate(trace):
        total += len(keys)
        n = 0
        while n < len(keys) and keys[n] in held:
            n += 1
        hits += n
        for depth, (key, use) in enumerate(zip(keys, nxt[r], strict=True)):
            if use == math.inf:
                held.pop(key, None)  # never again: drop it, or never admit it
                continue
            held[key] = use
            heapq.heappush(heap, (-use, -depth, key))
        while len(held) > capacity:
            neg_use, _, key = heapq.heappop(heap)
            if held.get(key) == -neg_use:
                del held[key]
    return hits / total


# -- replays ------------------------------------------------------------------------------


class _Values:
    """4 KiB envelopes, a header per depth."""

    def __init__(self) -> None:
        self.payload = bytes(CHUNK_BYTES - ENVELOPE_HEADER_SIZE)
        self._headers: dict[int, bytes] = {}

    def header(self, depth: int) -> bytes:
        head = self._headers.get(depth)
        if head is None:
            head = self._headers[depth] = seal(self.payload, chunk_index=depth,
                                               num_tokens=TOKENS_PER_CHUNK)
        return head


def replay_tier(trace: Trace, capacity: int, policy: str) -> dict[str, float]:
    """Prefix hit ratio (and wall time) of a DRAM tier of ``capacity`` chunks."""
    tier = DramTier(capacity * CHUNK_BYTES, policy=policy)
    values = _Values()
    hits = total = 0
    started = time.perf_counter()
    try:
        for keys in trace:
            total += len(keys)
            n = tier.lookup(keys)
            hits += n
            for entry in tier.acquire_many(keys[:n]):
                if entry is not None:
                    tier.release(entry)
            for depth in range(n, len(keys)):
                key = keys[depth]
                slot = tier.reserve(key, CHUNK_BYTES)
                if slot is None:
                    continue
                slot.view[:ENVELOPE_HEADER_SIZE] = values.header(depth)
                slot.view[ENVELOPE_HEADER_SIZE:] = values.payload
                tier.commit([slot], parents=[keys[depth - 1] if depth else None])
        return {"hit_ratio": hits / total, "seconds": time.perf_counter() - started}
    finally:
        tier.close()


def replay_tcp(trace: Trace, capacity: int, policy: str) -> dict[str, float]:
    """The same through a real node over TCP (the SDK's lookup, get_many, put)."""
    from bench._procs import start_node
    from kvpool.client import Client

    node = start_node("--dram-capacity", str(capacity * CHUNK_BYTES), "--no-ssd",
                      "--dram-allocate-ahead", "0", "--dram-policy", policy)
    values = _Values()
    hits = total = 0
    started = time.perf_counter()
    try:
        with Client(node.url) as client:
            for keys in trace:
                total += len(keys)
                n = client.lookup(keys)
                hits += n
                if n:
                    client.get_many(keys[:n])
                for depth in range(n, len(keys)):
                    client.put(keys[depth], values.payload, chunk_index=depth,
                               num_tokens=TOKENS_PER_CHUNK,
                               parent=keys[depth - 1] if depth else None)
        return {"hit_ratio": hits / total, "seconds": time.perf_counter() - started}
    finally:
        node.stop()


# -- the table ----------------------------------------------------------------------------


def run(name: str, trace: Trace, shares: Sequence[float], policies: Sequence[str],
        tcp: Sequence[float]) -> dict[str, Any]:
    info = describe(trace)
    inf = infinite(trace)
    print(f"\n{name}: {info['requests']:,} requests, {info['chunks']:,} chunks, "
          f"{info['distinct']:,} distinct ({info['asked_once']:.0%} asked once); "
          f"infinite capacity: {inf:.3f}")
    cols = "".join(f" | {p:>14}" for p in policies)
    tcols = "".join(f" | {p + ' tcp':>14}" for p in policies) if tcp else ""
    print(f"{'capacity':>9} {'chunks':>7} | {'optimum':>7}{cols}{tcols}")
    rows = []
    for share in shares:
        capacity = max(1, round(share * info["distinct"]))
        best = optimum(trace, capacity)
        row: dict[str, Any] = {"share": share, "capacity": capacity, "optimum": best}
        line = f"{share:>9.1%} {capacity:>7,} | {best:>7.3f}"
        for policy in policies:
            got = replay_tier(trace, capacity, policy)
            row[policy] = got
            line += f" | {got['hit_ratio']:.3f} {got['hit_ratio'] / best:>5.2f}x"
        if tcp:
            for policy in policies:
                if share in tcp:
                    got = replay_tcp(trace, capacity, policy)
                    row[f"{policy}_tcp"] = got
                    line += f" | {got['hit_ratio']:.3f} {got['hit_ratio'] / best:>5.2f}x"
                else:
                    line += f" | {'':>14}"
        print(line, flush=True)
        rows.append(row)
    return {"trace": name, **info, "infinite": inf, "rows": rows}


def _shares(text: str) -> list[float]:
    return [float(s) for s in text.split(",") if s]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.policy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*", type=Path, help="JSONL traces (hash_ids or tokens)")
    ap.add_argument("--synthetic", type=int, default=12_000, metavar="N",
                    help="requests of the synthetic trace, run when no trace file is given "
                         "(default 12000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capacities", type=_shares, default=list(CAPACITIES),
                    help="DRAM capacities as shares of the distinct chunks")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"eviction policies to replay (of {', '.join(POLICIES)})")
    ap.add_argument("--tcp", type=_shares, default=[],
                    help="capacities (of --capacities) to replay through a node over TCP too")
    args = ap.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    for policy in policies:
        if policy not in POLICIES:
            ap.error(f"unknown policy {policy!r} (one of {', '.join(POLICIES)})")
    results = []
    if args.traces:
        for path in args.traces:
            results.append(run(path.name, load(path), args.capacities, policies, args.tcp))
    else:
        results.append(run(f"synthetic (seed {args.seed})",
                           synthetic(args.synthetic, args.seed), args.capacities, policies,
                           args.tcp))
    print(f"\nwrote {save('policy', {'policies': policies, 'traces': results})}")


if __name__ == "__main__":
    main()
