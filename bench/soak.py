"""Fault and soak run: 3 nodes + S3 under 32 clients while nodes die, S3 stops, SSDs fill.

    python -m bench.soak [--duration 900] [--clients 32]

What runs, all on 127.0.0.1:

- S3: moto's server in a child process that keeps its objects in memory
  across stop/start (so "S3 down" is an outage, not data loss);
- a static 3-node cluster, replication 2, S3 write-through (a PUT is acked
  only once S3 has it: acked = durable), small DRAM (16 MiB) and SSD
  (16 MiB) tiers, so eviction, demotion and a full SSD happen all the time;
- ``--clients`` AsyncClients spread over 4 load processes, each looping
  over a mixed load (PUT 8%, GET 72%, LOOKUP 10%, EXISTS 6%, DELETE 4%) of
  values 2-16 KiB whose bytes are a function of their key, so every value
  read back is checked;
- faults on a schedule: SIGKILL a node and restart it 15 s later (three
  times, a different node each time), stop S3 for 20 s (twice);
- hostile clients for the whole run (``bench/_attacks.py``; ``--no-attacks``
  leaves them out): silent connections sending PUT headers for 12 MiB values
  without HELLO, to every cluster node; back-to-back maximal admin lookups
  (4M tokens) to every node; and against a fourth, standalone TLS node (DRAM
  only, 64 MiB) holding 40 canary chunks of 1 MiB: the same two attacks plus
  8 TLS clients that ask for a 4 MiB value 76 times each and never read,
  while a witness reads canaries over TLS and times each GET; and against the
  cluster's admin ports: JSON nested 1,000 deep and oversized bodies (every
  answer must be a 4xx JSON error), 20 event streams per node that never
  read (dropped by the node, opened again), 200 idle connections per node
  (closed by the node after --admin-idle-timeout, opened again).

At the end, with every node and S3 back, every chunk whose PUT was acked
and which was not deleted is read back from the cluster. Printed and written
to ``bench/results/soak.json``: operations done, errors by kind, wrong bytes
(must be 0), acked-durable chunks lost (must be 0), node RSS over time, and
latency percentiles per op; with the attacks, the target's evictions (must
be 0: nothing was allowed to evict its canaries), canaries intact, its RSS
growth against ATTACK_RSS_BOUND_MIB, and the witness's GET p50/p99/max. Exit
status 1 if wrong bytes, lost chunks, a target eviction, a damaged canary,
the RSS bound broken, or an admin answer that was a 5xx or not a JSON error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import xxhash

from bench._attacks import (
    AdminFlood,
    BadAdminBodies,
    MaximalLookups,
    SilentSubscribers,
    TlsNonReaders,
    UnauthenticatedPuts,
)
from kvpool.cli.local_cluster import LocalCluster, free_ports
from kvpool.client import AsyncClient, Client

RESULTS = Path(__file__).resolve().parent / "results"
OPS = (("put", 0.08), ("get", 0.72), ("lookup", 0.10), ("exists", 0.06), ("delete", 0.04))
PER_CLIENT_OPS_S = 40  # pacing: the cluster should be busy, not drowned
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
       "AWS_DEFAULT_REGION": "us-east-1"}
#: the attacked TLS node's RSS may grow at most this much over its start-of-attack RSS:
#: 8 non-reading TLS clients x (256 KiB copies + 256 KiB TLS buffer + socket buffers),
#: two lookups streamed to their parsers, 16 silent connections' scratch (64 KiB each),
#: with room for allocator slack
ATTACK_RSS_BOUND_MIB = 64


def value_for(key: bytes) -> bytes:
    """The only bytes ``key`` may ever be read back as (2-16 KiB, a function of the key)."""
    size = 2048 * (1 + key[0] % 8)
    return (key * (size // 16))[:size]


# -- S3 in a child process: stop/start keeps the objects ----------------------------------

def s3_server_main(port: int) -> None:
    """stdin commands: "stop", "start"; prints "ready" after each (the child's main)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "stop":
            server.stop()
        elif line.strip() == "start":
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            server.start()
        print("ready", flush=True)


class S3Process:
    def __init__(self) -> None:
        (self.port,) = free_ports(1)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from bench.soak import s3_server_main; "
             f"s3_server_main({self.port})"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env={**os.environ, **AWS}, stderr=subprocess.DEVNULL)
        self._wait()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _wait(self) -> None:
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the S3 server did not start")

    def command(self, what: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        self._wait()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


# -- load processes -----------------------------------------------------------------------

async def client_loop(seeds: list[str], wid: int, cid: int, deadline: float,
                      out: dict[str, Any]) -> None:
    rng = random.Random(wid * 1000 + cid)
    mine: list[bytes] = []
    names = [name for name, _ in OPS]
    weights = [weight for _, weight in OPS]
    lat = out["latency_ms"]
    n = 0
    async with AsyncClient(seeds, pool_size=1, timeout=5, connect_timeout=2, shm=False,
                           client_name=f"soak-{wid}-{cid}") as c:
        next_at = time.monotonic()
        while time.monotonic() < deadline:
            next_at += 1 / PER_CLIENT_OPS_S
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            op = rng.choices(names, weights)[0] if mine else "put"
            t0 = time.perf_counter()
            try:
                if op == "put":
                    n += 1
                    key = xxhash.xxh3_128_digest(f"soak-{wid}-{cid}-{n}".encode())
                    await c.put(key, value_for(key))
                    mine.append(key)
                    out["acked"].append(key.hex())
                elif op == "get":
                    key = rng.choice(mine)
                    got = await c.get(key)
                    if got is None:
                        out["misses"] += 1
                    elif got != value_for(key):
                        out["wrong_bytes"] += 1
                        out["wrong_keys"].append(key.hex())
                elif op == "lookup":
                    await c.lookup(rng.sample(mine, min(4, len(mine))))
                elif op == "exists":
                    await c.exists(rng.choice(mine))
                else:
                    key = mine.pop(rng.randrange(len(mine)))
                    out["deleted"].append(key.hex())  # before the call: it may half-happen
                    await c.delete(key)
            except Exception as exc:  # counted by kind: the soak's point is to see them
                kind = f"{op}: {type(exc).__name__}"
                out["errors"][kind] = out["errors"].get(kind, 0) + 1
                if kind not in out["first_traceback"]:
                    out["first_traceback"][kind] = traceback.format_exc()
                continue
            lat.setdefault(op, []).append((time.perf_counter() - t0) * 1e3)
            out["ops"] += 1


def load_main(seeds: list[str], wid: int, clients: int, deadline: float, path: str) -> None:
    out: dict[str, Any] = {"ops": 0, "misses": 0, "wrong_bytes": 0, "wrong_keys": [],
                           "errors": {}, "acked": [], "deleted": [], "latency_ms": {},
                           "first_traceback": {}}

    async def run() -> None:
        await asyncio.gather(*(client_loop(seeds, wid, i, deadline, out)
                               for i in range(clients)))

    asyncio.run(run())
    Path(path).write_text(json.dumps(out))


# -- the run --------------------------------------------------------------------------------

def sample_rss(cluster: LocalCluster, started: float, series: list[dict[str, Any]],
               stop: threading.Event) -> None:
    while not stop.wait(5.0):
        row: dict[str, Any] = {"t_s": round(time.monotonic() - started)}
        for node in cluster.nodes:
            try:
                proc = psutil.Process(node.proc.pid) if node.running and node.proc else None
                row[node.node_id] = proc.memory_info().rss >> 20 if proc else None
                # the node's SSD worker is its child: count it too
                row[node.node_id + "_worker"] = sum(
                    ch.memory_info().rss for ch in proc.children()) >> 20 if proc else None
            except psutil.Error:
                row[node.node_id] = None
        series.append(row)


def faults(cluster: LocalCluster, s3: S3Process, duration: float, *, started: float,
           log: list[dict[str, Any]], stop: threading.Event) -> None:
    plan = [(0.10, "kill", 1), (0.25, "s3", 0), (0.45, "kill", 2), (0.60, "s3", 0),
            (0.75, "kill", 0)]
    for at, what, index in plan:
        if stop.wait(max(0.0, started + at * duration - time.monotonic())):
            return
        t = round(time.monotonic() - started, 1)
        if what == "kill":
            cluster.kill(index)
            log.append({"t_s": t, "fault": f"SIGKILL {cluster.nodes[index].node_id}"})
            if stop.wait(15):
                cluster.restart(index)
                return
            cluster.restart(index)
            log.append({"t_s": round(time.monotonic() - started, 1),
                        "fault": f"restarted {cluster.nodes[index].node_id}"})
        else:
            s3.command("stop")
            log.append({"t_s": t, "fault": "S3 stopped"})
            stop.wait(20)
            s3.command("start")
            log.append({"t_s": round(time.monotonic() - started, 1), "fault": "S3 back"})


async def verify(seeds: list[str], keys: list[bytes]) -> dict[str, Any]:
    """Read back every acked, undeleted chunk: found and right, or counted."""
    lost: list[str] = []
    wrong = 0
    async with AsyncClient(seeds, timeout=30, shm=False) as c:
        for start in range(0, len(keys), 64):
            part = keys[start : start + 64]
            for attempt in range(3):
                try:
                    values = await c.get_many(part)
                    break
                except Exception:
                    if attempt == 2:
                        raise
                    await asyncio.sleep(1)
            for key, value in zip(part, values, strict=True):
                if value is None:
                    lost.append(key.hex())
                elif value != value_for(key):
                    wrong += 1
    return {"checked": len(keys), "lost": len(lost), "lost_keys": lost[:20], "wrong": wrong}


class AttackTarget:
    """A standalone TLS node with canary chunks, its attackers and a witness reader."""

    def __init__(self, tmp: str, cluster: LocalCluster, stop: threading.Event) -> None:
        import ssl

        import trustme  # the test extra: a CA made here, for the TLS node

        from bench._procs import start_node

        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1")
        paths = {name: os.path.join(tmp, f"target-{name}.pem") for name in ("ca", "cert", "key")}
        ca.cert_pem.write_to_path(paths["ca"])
        cert.private_key_and_cert_chain_pem.write_to_path(paths["cert"])
        cert.private_key_pem.write_to_path(paths["key"])
        self.node = start_node("--dram-capacity", "64MiB", "--no-ssd", "--data-dir",
                               os.path.join(tmp, "target"), "--tls-cert", paths["cert"],
                               "--tls-key", paths["key"])
        self.ssl = ssl.create_default_context(cafile=paths["ca"])
        self.canaries = {xxhash.xxh3_128_digest(b"canary%d" % i): os.urandom(1 << 20)
                         for i in range(40)}
        bait = b"attack-tls-bait!"
        with Client(self.node.url, ssl=self.ssl, shm=False) as c:
            c.put_many(list(self.canaries), list(self.canaries.values()))
            c.put(bait, os.urandom(4 << 20))
        self.process = psutil.Process(self.node.proc.pid)
        self.rss_first = self.rss_peak = self.process.memory_info().rss
        self.stop = stop
        cluster_data = [tuple(n.seed.rsplit(":", 1)) for n in cluster.nodes]
        data = [(h, int(p)) for h, p in cluster_data] + [("127.0.0.1", self.node.port)]
        admin_urls = [n.admin_url for n in cluster.nodes]
        self.attackers: dict[str, Any] = {
            "unauthenticated_puts": UnauthenticatedPuts(data, stop),
            "maximal_lookups": MaximalLookups([n.admin_url for n in cluster.nodes]
                                              + [self.node.admin_url], stop),
            "tls_non_readers": TlsNonReaders("127.0.0.1", self.node.port, self.ssl, bait,
                                             stop),
            "bad_admin_bodies": BadAdminBodies(admin_urls, stop),
            "silent_subscribers": SilentSubscribers(admin_urls, stop),
            # under the admin cap (256): past it, the flood would shut the other admin
            # attacks out too (tests/server/test_hostile_admin.py floods past the cap)
            "admin_flood": AdminFlood(admin_urls, stop, per_node=200),
        }
        self.latency_ms: list[float] = []
        self.witness_wrong = 0
        self.witness_errors: Counter[str] = Counter()
        self._threads = [*self.attackers.values(),
                         threading.Thread(target=self._witness, daemon=True),
                         threading.Thread(target=self._sample, daemon=True)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _witness(self) -> None:
        keys = list(self.canaries)
        rng = random.Random(3)
        with Client(self.node.url, ssl=self.ssl, shm=False, timeout=30) as c:
            while not self.stop.wait(0.01):
                key = rng.choice(keys)
                started = time.perf_counter()
                try:
                    got = c.get(key)
                except Exception as exc:
                    self.witness_errors[type(exc).__name__] += 1
                    continue
                self.latency_ms.append((time.perf_counter() - started) * 1e3)
                if got is None:
                    self.witness_errors["miss"] += 1  # evicted: the target has no other load
                elif bytes(got) != self.canaries[key]:
                    self.witness_wrong += 1

    def _sample(self) -> None:
        while not self.stop.wait(0.5):
            with contextlib.suppress(psutil.Error):
                self.rss_peak = max(self.rss_peak, self.process.memory_info().rss)

    def finish(self) -> dict[str, Any]:
        for t in self._threads:
            t.join(90)
        with Client(self.node.url, ssl=self.ssl, shm=False, timeout=30) as c:
            intact = sum(got is not None and bytes(got) == value for got, value in zip(
                c.get_many(list(self.canaries)), self.canaries.values(), strict=True))
            stats = c.stats()
        self.node.stop()
        growth = (self.rss_peak - self.rss_first) / (1 << 20)
        lat = self.latency_ms
        return {
            "attackers": {name: a.summary() for name, a in self.attackers.items()},
            "target_evictions": stats["evictions"], "canaries_intact": intact,
            "canaries": len(self.canaries),
            "target_rss_first_mib": round(self.rss_first / (1 << 20), 1),
            "target_rss_growth_mib": round(growth, 1),
            "rss_bound_mib": ATTACK_RSS_BOUND_MIB, "rss_bound_held": growth <= ATTACK_RSS_BOUND_MIB,
            "witness": {"n": len(lat), "p50_ms": round(percentile(lat, 0.5), 2),
                        "p99_ms": round(percentile(lat, 0.99), 2),
                        "max_ms": round(max(lat), 1) if lat else None,
                        "wrong_bytes": self.witness_wrong,
                        "errors": dict(self.witness_errors)},
        }


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=900.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--workers", type=int, default=4, help="load processes")
    parser.add_argument("--out", default=str(RESULTS / "soak.json"))
    parser.add_argument("--no-attacks", action="store_true",
                        help="leave out the hostile clients (bench/_attacks.py)")
    args = parser.parse_args()
    os.environ.update(AWS)
    import boto3

    s3 = S3Process()
    bucket = "kvpool-soak"
    boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1").create_bucket(
        Bucket=bucket)
    tmp = tempfile.mkdtemp(prefix="kvpool-soak-")
    serve = ["--dram-capacity", "16MiB", "--ssd-capacity", "16MiB", "--s3-bucket", bucket,
             "--s3-endpoint", s3.endpoint, "--s3-write-through", "--s3-relist", "5"]
    cluster = LocalCluster(3, replication=2, data_dir=tmp, serve_args=serve)
    rss: list[dict[str, Any]] = []
    fault_log: list[dict[str, Any]] = []
    stop = threading.Event()
    attack_stop = threading.Event()
    target: AttackTarget | None = None
    attacks: dict[str, Any] | None = None
    try:
        cluster.start()
        if not args.no_attacks:
            target = AttackTarget(tmp, cluster, attack_stop)
            target.start()
        started = time.monotonic()
        deadline_wall = time.time() + args.duration
        threads = [threading.Thread(target=sample_rss, args=(cluster, started, rss, stop)),
                   threading.Thread(target=faults, args=(cluster, s3, args.duration),
                                    kwargs={"started": started, "log": fault_log,
                                            "stop": stop})]
        for t in threads:
            t.start()
        ctx = mp.get_context("spawn")
        per = [args.clients // args.workers + (i < args.clients % args.workers)
               for i in range(args.workers)]
        paths = [os.path.join(tmp, f"load-{i}.json") for i in range(args.workers)]
        # the load processes get the deadline as monotonic time of their own: pass seconds
        procs = [ctx.Process(target=_load_entry, args=(cluster.seeds, i, per[i],
                                                       deadline_wall, paths[i]))
                 for i in range(args.workers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(args.duration + 120)
        attack_stop.set()
        if target is not None:
            attacks = target.finish()
            target = None
        stop.set()
        for t in threads:
            t.join()
        for i, node in enumerate(cluster.nodes):  # everything back before the check
            if not node.running:
                cluster.restart(i)
        loads = [json.loads(Path(p).read_text()) for p in paths]
        deleted = {k for w in loads for k in w["deleted"]}
        durable = [bytes.fromhex(k) for w in loads for k in w["acked"] if k not in deleted]
        time.sleep(6)  # one S3 relist interval: nodes learn what S3 holds
        check = asyncio.run(verify(cluster.seeds, durable))
        snapshots = []
        for node in cluster.nodes:
            with urllib_open(f"{node.admin_url}/v1/stats") as snap:
                snapshots.append(snap)
    finally:
        stop.set()
        attack_stop.set()
        if target is not None:
            target.node.stop()
        codes = cluster.stop()
        s3.close()
    return report(args, loads, check, rss=rss, fault_log=fault_log, snapshots=snapshots,
                  codes=codes, attacks=attacks)


def urllib_open(url: str) -> Any:
    import contextlib
    import urllib.request

    @contextlib.contextmanager
    def get() -> Any:
        with urllib.request.urlopen(url, timeout=10) as r:
            yield json.load(r)

    return get()


def _load_entry(seeds: list[str], wid: int, clients: int, deadline_wall: float,
                path: str) -> None:
    load_main(seeds, wid, clients, time.monotonic() + (deadline_wall - time.time()), path)


def report(args: argparse.Namespace, loads: list[dict[str, Any]], check: dict[str, Any], *,
           rss: list[dict[str, Any]], fault_log: list[dict[str, Any]],
           snapshots: list[dict[str, Any]], codes: list[int | None],
           attacks: dict[str, Any] | None = None) -> int:
    errors: dict[str, int] = {}
    tracebacks: dict[str, str] = {}
    latency: dict[str, list[float]] = {}
    for w in loads:
        for kind, text in w["first_traceback"].items():
            tracebacks.setdefault(kind, text)
        for k, v in w["errors"].items():
            errors[k] = errors.get(k, 0) + v
        for op, values in w["latency_ms"].items():
            latency.setdefault(op, []).extend(values)
    ops = sum(w["ops"] for w in loads)
    wrong = sum(w["wrong_bytes"] for w in loads) + check["wrong"]
    node_ids = [k for k in rss[0] if k != "t_s" and not k.endswith("_worker")] if rss else []
    rss_summary = {}
    for nid in node_ids:
        series = [r[nid] for r in rss if r.get(nid) is not None]
        workers = [r[nid + "_worker"] for r in rss if r.get(nid + "_worker") is not None]
        if series:
            rss_summary[nid] = {"first_mib": series[0], "peak_mib": max(series),
                                "last_mib": series[-1],
                                "median_second_half_mib": statistics.median(
                                    series[len(series) // 2:]),
                                "worker_peak_mib": max(workers) if workers else None}
    result = {
        "duration_s": args.duration, "clients": args.clients,
        "ops_ok": ops, "ops_per_s": round(ops / args.duration, 1),
        "errors": dict(sorted(errors.items())), "first_traceback": tracebacks,
        "get_misses": sum(w["misses"] for w in loads),
        "wrong_bytes": wrong, "acked_durable": check["checked"], "durable_lost": check["lost"],
        "lost_keys": check["lost_keys"],
        "latency_ms": {op: {"n": len(v), "p50": round(percentile(v, 0.5), 2),
                            "p99": round(percentile(v, 0.99), 2),
                            "max": round(max(v), 1)} for op, v in sorted(latency.items())},
        "rss": rss_summary, "rss_series": rss, "faults": fault_log,
        "ssd": {s["node_id"]: {k: s["tiers"]["ssd"].get(k) for k in
                               ("used_bytes", "capacity_bytes", "evictions", "shed",
                                "refused")} for s in snapshots},
        "node_exit_codes": codes,
        "attacks": attacks,
    }
    RESULTS.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nkvpool soak: {args.duration:.0f} s, {args.clients} clients, 3 nodes (replication 2) "
          f"+ S3 write-through")
    faults_text = ", ".join(f"{f['t_s']}s {f['fault']}" for f in fault_log)
    print(f"faults: {faults_text}")
    print("\n| operations ok | ops/s | wrong bytes | acked-durable chunks | lost |")
    print("|---|---|---|---|---|")
    print(f"| {ops} | {result['ops_per_s']} | {wrong} | {check['checked']} | {check['lost']} |")
    print("\n| op | n | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|")
    for op, s in result["latency_ms"].items():
        print(f"| {op} | {s['n']} | {s['p50']} | {s['p99']} | {s['max']} |")
    print("\n| errors (op: kind) | count |\n|---|---|")
    for kind, count in result["errors"].items():
        print(f"| {kind} | {count} |")
    print("\n| node | RSS first MiB | peak | last | SSD worker peak |\n|---|---|---|---|---|")
    for nid, r in rss_summary.items():
        print(f"| {nid} | {r['first_mib']} | {r['peak_mib']} | {r['last_mib']} "
              f"| {r['worker_peak_mib']} |")
    print(f"\nGET misses (allowed: a cache may drop): {result['get_misses']}; SSD: "
          f"{json.dumps(result['ssd'])}; written to {args.out}")
    failed = bool(wrong or check["lost"])
    if attacks is not None:
        w = attacks["witness"]
        print("\n| attacks beside the load | |\n|---|---|")
        for name, summary in attacks["attackers"].items():
            print(f"| {name} | {json.dumps(summary)} |")
        print(f"| target evictions (must be 0) | {attacks['target_evictions']} |")
        print(f"| canaries intact | {attacks['canaries_intact']} / {attacks['canaries']} |")
        print(f"| target RSS growth | {attacks['target_rss_growth_mib']} MiB (bound "
              f"{attacks['rss_bound_mib']} MiB, from {attacks['target_rss_first_mib']} MiB) |")
        print(f"| witness TLS GET of 1 MiB | n {w['n']}, p50 {w['p50_ms']} ms, p99 "
              f"{w['p99_ms']} ms, max {w['max_ms']} ms, wrong {w['wrong_bytes']}, errors "
              f"{w['errors']} |")
        failed = failed or bool(attacks["target_evictions"] or w["wrong_bytes"]
                                or attacks["attackers"]["bad_admin_bodies"]["server_errors"]
                                or attacks["canaries_intact"] != attacks["canaries"]
                                or not attacks["rss_bound_held"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
