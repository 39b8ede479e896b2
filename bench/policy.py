"""Which chunks a DRAM tier keeps: prefix hit ratio against capacity, each eviction policy
beside the offline optimum and infinite capacity, on request traces.

    python -m bench.policy [TRACE.jsonl ...] [--synthetic N] [--capacities 0.01,0.02,...]
                           [--policies chain,lru] [--tcp 0.01,0.1] [--ssd 0.05]
                           [--plot docs/img/policy.png] [--hot-path-runs 5] [--seed 0]

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
chunk hits are prefix hits. The ``+oracle`` column splits the gap to it: the first policy
given, with an admission oracle (a chunk no later request asks for is never stored), so
what is left between that column and the optimum is the policy's eviction, and what lies
between the policy and that column is what knowing the one-hit wonders would buy.

``--ssd SHARE`` replays over TCP once more with the SSD tier on (room for every chunk)
below a DRAM tier of that share, for each admission (``--ssd-admit all``, ``reused``):
hits, hits served from the SSD, the SSD's writes, flash writes per hit, write-behinds
shed and held back. Last, the hot path: each policy's cost per store and per read, in
process and through a node (PUT and GET p50 of 4 KiB, 64 KiB and 1 MiB chunks: a node a
policy, side by side, their calls interleaved one by one).

Prints tables (hit ratio, and its ratio to the optimum) and writes
bench/results/policy.json (``--plot``: a PNG of hit ratio against capacity).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import xxhash

from bench._procs import Proc, start_node
from bench._stats import fmt, save, summary
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


def next_uses(trace: Trace) -> list[list[float]]:
    """For each chunk of each request, the index of the next request that asks for it
    (``math.inf``: none does)."""
    nxt: list[list[float]] = [[]] * len(trace)
    last: dict[bytes, int] = {}
    for r in range(len(trace) - 1, -1, -1):
        keys = trace[r]
        nxt[r] = [last.get(k, math.inf) for k in keys]
        for k in keys:
            last[k] = r
    return nxt


def optimum(trace: Trace, capacity: int, nxt: list[list[float]] | None = None) -> float:
    """Belady's MIN with bypass, ``capacity`` chunks: its prefix hit ratio (``nxt``: the
    trace's :func:`next_uses`, if already made)."""
    if nxt is None:
        nxt = next_uses(trace)
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

    def store(self, tier: DramTier, key: bytes, depth: int, parent: bytes | None) -> bool:
        """One chunk into ``tier`` with its parent, as a PUT frame does (reserve, fill,
        commit); False where it found no room."""
        slot = tier.reserve(key, CHUNK_BYTES)
        if slot is None:
            return False
        slot.view[:ENVELOPE_HEADER_SIZE] = self.header(depth)
        slot.view[ENVELOPE_HEADER_SIZE:] = self.payload
        tier.commit([slot], parents=[parent])
        return True


def _read(tier: DramTier, keys: Sequence[bytes]) -> None:
    """Read ``keys`` as a GET does (held, then released)."""
    for entry in tier.acquire_many(keys):
        if entry is not None:
            tier.release(entry)


def _node(capacity_bytes: int, policy: str, *flags: str) -> Proc:
    """A node of ``capacity_bytes`` of DRAM under ``policy``, nothing allocated ahead."""
    return start_node("--dram-capacity", str(capacity_bytes), "--dram-allocate-ahead", "0",
                      "--dram-policy", policy, *flags)


def replay_tier(trace: Trace, capacity: int, policy: str, *,
                nxt: list[list[float]] | None = None) -> dict[str, float]:
    """Prefix hit ratio (and wall time) of a DRAM tier of ``capacity`` chunks. With
    ``nxt`` (:func:`next_uses`), an admission oracle: a chunk no later request asks for
    is never stored (what ``policy`` gets when told which chunks are one-hit wonders)."""
    tier = DramTier(capacity * CHUNK_BYTES, policy=policy)
    values = _Values()
    hits = total = 0
    started = time.perf_counter()
    try:
        for r, keys in enumerate(trace):
            total += len(keys)
            n = tier.lookup(keys)
            hits += n
            _read(tier, keys[:n])
            for depth in range(n, len(keys)):
                if nxt is not None and nxt[r][depth] == math.inf:
                    continue
                values.store(tier, keys[depth], depth, keys[depth - 1] if depth else None)
        return {"hit_ratio": hits / total, "seconds": time.perf_counter() - started}
    finally:
        tier.close()


def replay_tcp(trace: Trace, capacity: int, policy: str, ssd_admit: str | None = None
               ) -> dict[str, float]:
    """The same through a real node over TCP (the SDK's lookup, get_many, put). With
    ``ssd_admit``, the node runs its SSD tier (room for every chunk) with that admission,
    and the result counts hits served from the SSD and the SSD's writes."""
    from kvpool.client import Client

    below = ("--no-ssd",) if ssd_admit is None \
        else ("--ssd-admit", ssd_admit, "--ssd-capacity", "4GiB")
    node = _node(capacity * CHUNK_BYTES, policy, *below)
    values = _Values()
    hits = total = from_ssd = 0
    started = time.perf_counter()
    try:
        with Client(node.url) as client:
            for keys in trace:
                total += len(keys)
                tiers = client.lookup_tiers(keys)
                n = len(tiers)
                hits += n
                from_ssd += tiers.count("ssd")
                if n:
                    client.get_many(keys[:n])
                for depth in range(n, len(keys)):
                    client.put(keys[depth], values.payload, chunk_index=depth,
                               num_tokens=TOKENS_PER_CHUNK,
                               parent=keys[depth - 1] if depth else None)
            seconds = time.perf_counter() - started
            out = {"hit_ratio": hits / total, "seconds": seconds}
            if ssd_admit is not None:
                ssd = client.stats()["tiers"]["ssd"]
                out.update(ssd_hits=from_ssd, ssd_writes=ssd["writes"], shed=ssd["shed"],
                           held_back=ssd["held_back"])
        return out
    finally:
        node.stop()


def run_ssd(trace: Trace, share: float, distinct: int) -> dict[str, Any]:
    """DRAM of ``share`` of the distinct chunks over an SSD with room for all: each
    admission (with the default chain policy; lru + all as the tiers were), flash writes
    per hit."""
    capacity = max(1, round(share * distinct))
    print(f"\nwith the SSD tier (DRAM {share:.1%} = {capacity:,} chunks, SSD room for all; "
          "replayed over TCP as fast as it goes)")
    print(f"{'policy':>6} {'admit':>7} | {'hit':>6} {'ssd hits':>9} {'ssd writes':>10} "
          f"{'writes/hit':>10} {'shed':>6} {'held back':>9} {'time':>6}")
    rows = []
    for policy, admit in (("lru", "all"), ("chain", "all"), ("chain", "reused")):
        got = replay_tcp(trace, capacity, policy, admit)
        hit_chunks = got["hit_ratio"] * sum(map(len, trace))
        per_hit = got["ssd_writes"] / hit_chunks if hit_chunks else math.inf
        print(f"{policy:>6} {admit:>7} | {got['hit_ratio']:>6.3f} {got['ssd_hits']:>9,.0f} "
              f"{got['ssd_writes']:>10,.0f} {per_hit:>10.3f} {got['shed']:>6,.0f} "
              f"{got['held_back']:>9,.0f} {got['seconds']:>5.0f}s", flush=True)
        rows.append({"policy": policy, "admit": admit, "writes_per_hit": per_hit, **got})
    return {"share": share, "capacity": capacity, "rows": rows}


# -- the hot path -------------------------------------------------------------------------


def hot_path(policy: str, *, capacity: int = 4096, ops: int = 20_000, seed: int = 0
             ) -> dict[str, float]:
    """Microseconds per store (evicting: the tier is full) and per read of a held chunk,
    in a DRAM tier of ``capacity`` chunks, each a chunk of a chain of 8 with its parent."""
    tier = DramTier(capacity * CHUNK_BYTES, policy=policy)
    values = _Values()
    rng = random.Random(seed)
    keys = [i.to_bytes(16, "big") for i in range(capacity + ops)]
    try:
        for i in range(capacity):
            _store_in_chain(tier, values, keys, i)
        started = time.perf_counter()
        for i in range(capacity, capacity + ops):
            _store_in_chain(tier, values, keys, i)
        put = time.perf_counter() - started
        held = tier.keys()
        picks = [held[rng.randrange(len(held))] for _ in range(ops)]
        started = time.perf_counter()
        for key in picks:
            tier.lookup([key])
            _read(tier, [key])
        get = time.perf_counter() - started
        return {"put_us": put / ops * 1e6, "get_us": get / ops * 1e6}
    finally:
        tier.close()


def _store_in_chain(tier: DramTier, values: _Values, keys: Sequence[bytes], i: int) -> None:
    """``keys[i]``, a chunk of a chain of 8 (its parent the key before it)."""
    depth = i % 8
    if not values.store(tier, keys[i], depth, keys[i - 1] if depth else None):
        raise RuntimeError("no room in a tier with nothing held")


def hot_path_tcp(policies: Sequence[str], *, chunk_bytes: int = CHUNK_BYTES,
                 capacity: int = 2000, ops: int = 5000) -> dict[str, dict[str, float]]:
    """p50 microseconds of a PUT (into a full tier: each evicts) and of a GET, one chunk a
    call through a node, the sync SDK with its defaults (on the same host: values of 1 MiB
    and more written through shared memory, of 64 KiB and more read through the arena
    index; the rest over TCP), for each policy: a node each, started together, their
    calls interleaved one by one (the order alternating), so that what slows the machine
    for a while slows every policy alike."""
    from kvpool.client import Client

    payload = bytes(chunk_bytes - ENVELOPE_HEADER_SIZE)
    keys = [i.to_bytes(16, "big") for i in range(ops)]
    nodes: list[Proc] = []
    clients: list[Client] = []
    try:
        for policy in policies:
            nodes.append(_node(capacity * chunk_bytes, policy, "--no-ssd"))
            clients.append(Client(nodes[-1].url))
        puts: list[list[float]] = [[] for _ in policies]
        gets: list[list[float]] = [[] for _ in policies]
        turns = [list(range(len(policies))), list(range(len(policies)))[::-1]]
        for i, key in enumerate(keys):
            parent = keys[i - 1] if i % 8 else None
            for p in turns[i % 2]:
                started = time.perf_counter()
                clients[p].put(key, payload, chunk_index=i % 8, parent=parent)
                puts[p].append(time.perf_counter() - started)
        for i, key in enumerate(keys[-capacity // 2:]):
            for p in turns[i % 2]:
                started = time.perf_counter()
                clients[p].get(key)
                gets[p].append(time.perf_counter() - started)
        return {policy: {"put_p50_us": statistics.median(puts[p][capacity:]) * 1e6,
                         "get_p50_us": statistics.median(gets[p]) * 1e6}
                for p, policy in enumerate(policies)}
    finally:
        for client in clients:
            client.close()
        for node in nodes:
            node.stop()


def run_hot_path(policies: Sequence[str], runs: int) -> dict[str, Any]:
    """Each policy's store and read cost (median and range of ``runs``): in process one
    policy after another (their order alternating by run), through nodes side by side."""
    got: dict[str, dict[str, list[float]]] = {p: {} for p in policies}
    for i in range(runs):
        for policy in policies if i % 2 == 0 else policies[::-1]:
            for k, v in hot_path(policy).items():
                got[policy].setdefault(k, []).append(v)
        # 4 KiB, 64 KiB, and 1 MiB: nearer an engine's chunk (128 tokens of SmolLM2-135M
        # in bf16: 2.8 MiB)
        for sfx, sizes in (("", {}), ("_64k", {"chunk_bytes": 64 << 10}),
                           ("_1m", {"chunk_bytes": 1 << 20, "capacity": 256, "ops": 1024})):
            for policy, measured in hot_path_tcp(policies, **sizes).items():
                for k, v in measured.items():
                    got[policy].setdefault(k + sfx, []).append(v)
    print(f"\nhot path, 4 KiB chunks unless said, tier full, chains of 8 (median [min-max] "
          f"of {runs} runs; through a node: a node a policy, their calls interleaved)")
    out: dict[str, Any] = {}
    for policy in policies:
        row = {k: summary(v) for k, v in got[policy].items()}
        out[policy] = row
        print(f"  {policy:>6}: in process: store {fmt(row['put_us'], ' us')}, lookup+read "
              f"{fmt(row['get_us'], ' us')}; {_through_a_node(row, ' us')}")
    if len(policies) > 1:  # each run's figures over the same run's of the last policy
        base = policies[-1]
        for policy in policies[:-1]:
            ratios = {k: summary([a / b for a, b in zip(v, got[base][k], strict=True)])
                      for k, v in got[policy].items()}
            out[f"{policy} / {base}"] = ratios
            print(f"  {policy} / {base}, paired by run: in process: store "
                  f"{fmt(ratios['put_us'], 'x')}; {_through_a_node(ratios, 'x')}")
    return out


def _through_a_node(row: dict[str, dict[str, float]], unit: str) -> str:
    """A hot-path row's PUT and GET p50 through a node, for each chunk size."""
    return "; ".join(f"{label}: PUT p50 {fmt(row['put_p50_us' + sfx], unit)}, GET p50 "
                     f"{fmt(row['get_p50_us' + sfx], unit)}"
                     for label, sfx in (("through a node", ""), ("64 KiB chunks", "_64k"),
                                        ("1 MiB chunks", "_1m")))


# -- the table ----------------------------------------------------------------------------


def run(name: str, trace: Trace, shares: Sequence[float], policies: Sequence[str], *,
        tcp: Sequence[float], ssd: float | None = None) -> dict[str, Any]:
    info = describe(trace)
    inf = infinite(trace)
    print(f"\n{name}: {info['requests']:,} requests, {info['chunks']:,} chunks, "
          f"{info['distinct']:,} distinct ({info['asked_once']:.0%} asked once); "
          f"infinite capacity: {inf:.3f}")
    nxt = next_uses(trace)
    oracle = f"{policies[0]}+oracle"
    cols = "".join(f" | {p:>14}" for p in [*policies, oracle])
    tcols = "".join(f" | {p + ' tcp':>14}" for p in policies) if tcp else ""
    print(f"{'capacity':>9} {'chunks':>7} | {'optimum':>7}{cols}{tcols}")
    rows = []
    for share in shares:
        capacity = max(1, round(share * info["distinct"]))
        best = optimum(trace, capacity, nxt)
        row: dict[str, Any] = {"share": share, "capacity": capacity, "optimum": best}
        line = f"{share:>9.1%} {capacity:>7,} | {best:>7.3f}"
        for policy in policies:
            got = replay_tier(trace, capacity, policy)
            row[policy] = got
            line += f" | {got['hit_ratio']:.3f} {got['hit_ratio'] / best:>5.2f}x"
        got = replay_tier(trace, capacity, policies[0], nxt=nxt)
        row["admission_oracle"] = {"policy": policies[0], **got}
        line += f" | {got['hit_ratio']:.3f} {got['hit_ratio'] / best:>5.2f}x"
        if tcp:
            for policy in policies:
                if share in tcp:
                    got = replay_tcp(trace, capacity, policy)
                    row[f"{policy}_tcp"] = got
                    line += f" | {got['hit_ratio']:.3f} {got['hit_ratio'] / best:>5.2f}x"
                    line += f" {got['seconds']:.0f}s"
                else:
                    line += f" | {'':>14}"
        print(line, flush=True)
        rows.append(row)
    result = {"trace": name, **info, "infinite": inf, "rows": rows}
    if ssd is not None:
        result["ssd"] = run_ssd(trace, ssd, info["distinct"])
    return result


def plot(result: dict[str, Any], policies: Sequence[str], path: Path) -> bool:
    """Hit ratio against capacity, each policy beside the optimum: a PNG (False without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: matplotlib is not installed: pip install matplotlib)")
        return False
    rows = result["rows"]
    shares = [r["share"] * 100 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(shares, [r["optimum"] for r in rows], "k--", label="optimum (Belady MIN)")
    for policy in policies:
        ax.plot(shares, [r[policy]["hit_ratio"] for r in rows], "o-", label=policy)
    ax.plot(shares, [r["admission_oracle"]["hit_ratio"] for r in rows], ":",
            label=f"{policies[0]}, never storing a one-hit wonder (oracle)")
    ax.axhline(result["infinite"], color="grey", lw=0.8, label="infinite capacity")
    ax.set(xscale="log", xlabel="DRAM capacity (% of distinct chunks)",
           ylabel="prefix hit ratio", title=result["trace"])
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"wrote {path}")
    return True


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
    ap.add_argument("--ssd", type=float, default=None, metavar="SHARE",
                    help="replay over TCP with the SSD tier on too, DRAM of this share: "
                         "flash writes per hit for each admission")
    ap.add_argument("--plot", type=Path, default=None, metavar="PNG",
                    help="write the first trace's hit ratio against capacity there")
    ap.add_argument("--hot-path-runs", type=int, default=5, metavar="N",
                    help="runs of the per-operation cost check (0: skip it)")
    args = ap.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    for policy in policies:
        if policy not in POLICIES:
            ap.error(f"unknown policy {policy!r} (one of {', '.join(POLICIES)})")
    results = []
    if args.traces:
        for path in args.traces:
            results.append(run(path.name, load(path), args.capacities, policies,
                               tcp=args.tcp, ssd=args.ssd))
    else:
        results.append(run(f"synthetic (seed {args.seed})",
                           synthetic(args.synthetic, args.seed), args.capacities, policies,
                           tcp=args.tcp, ssd=args.ssd))
    if args.plot is not None:
        plot(results[0], policies, args.plot)
    hot = run_hot_path(policies, args.hot_path_runs) if args.hot_path_runs else None
    print(f"\nwrote {save('policy', {'policies': policies, 'traces': results, 'hot_path': hot})}")


if __name__ == "__main__":
    main()
