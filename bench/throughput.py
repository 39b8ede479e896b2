"""Single-node throughput and latency, against the loopback ceiling and Redis, in one run.

    python -m bench.throughput            # full run, 1-3 minutes on 2 cores
    python -m bench.throughput --quick    # smoke run

Starts a kvpool node (DRAM only: ``--no-ssd``, this measures the data path; see
``bench.tiers`` for the SSD tier), ``redis-server`` and ``iperf3 -s`` on
127.0.0.1 and, for each
value size, interleaves the runs of every system so that machine noise hits them
alike (each run's sample of a series is 8 blocks of its calls, taken in turn with the
other series' blocks). Prints a table (median and min-max GB/s of ``--runs`` runs, ops/s, ratios:
the median of the per-run ratios, each sample paired with the other series' sample of
the same run) and writes JSON. Targets are the issue's: GET >= 0.85x iperf3, >= 1.0x raw Python,
>= 2.0x Redis; PUT >= 0.75x iperf3; EXISTS/LOOKUP of 512 keys p50 <= 1 ms; RSS of a
full DRAM tier <= capacity x 1.10 + 150 MB. ``raw python`` is a one-way stream;
``raw python request/reply`` asks for one value at a time over a bare socket (a 16-byte
request, the value back, nothing parsed or checked): the most a call for one value can
move in Python here, the ceiling of the one-value-a-call rows.

The ``kvpool ...`` series go over TCP (``shm=False``): the sync client's calls run on
its blocking socket, and those marked ``(loop)`` make the same calls on the
client's event loop (``blocking=False``, as every sync call did before): the
before/after of the blocking path, in one run. The 4 KiB latency rows put
them beside Redis (redis-py + hiredis) and a raw Python socket asking the node
the same GET (the floor: no parsing, no checks), once as the scheduler places
the processes, once with all of them on one CPU (``on_one_cpu``), and once with
the client on one CPU and the node and Redis on another (``split CPUs``, where
the machine has two: every reply crosses CPUs, as between an engine and a node on
cores of their own; as scheduled, which of the servers shares the client's CPU
varies from run to run and decides these rows). The ``kvpool shm ...`` series
take the same-host fast path (values copied from the node's shared-memory arena),
and ``memcpy`` is its ceiling: numpy ``copyto`` of the same sizes into a
preallocated buffer, from as many distinct sources as the node holds values (so
that, like the fast path, it reads memory, not cache). Fast-path targets: GET at
1 and 4 MiB >= 2x TCP and >= 0.6x memcpy. ``memcpy x8`` / ``memcpy xN`` copy a
batch's values into the same caller buffers the batched series fill: the
like-for-like ceiling once the destination no longer fits in cache (the
"same buffers" ratio). ``copy+verify x8`` / ``xN`` is the fast path's own ceiling:
the client's copy, checksum and generation check of a batch from an arena-shaped
memfd into those buffers, with no request at all (the ``÷ copy+verify`` ratio is
what the rest of the call leaves of it). The ``shm get`` series read through the
node's arena index (no request; the client's default); those marked ``(GET_SHM)``
ask the node for each call's values under a lease (``shm_index=False``), the
round trip per call the index saves. ``shm put`` writes into arena slots
(the client's default for calls of 1 MiB and more). Batched series move 8 values a call;
those marked ``xN`` move N values (64 MiB, or every key the node holds), where
the round trip is amortised. PUT sources are as distinct as GET's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import mmap
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench._procs import Proc, start_iperf3, start_node, start_redis
from kvpool.client import Client
from kvpool.client._shm import ShmMapping
from kvpool.protocol.envelope import seal
from kvpool.protocol.errors import Status
from kvpool.protocol.frames import (
    FRAME_HEADER_SIZE,
    PROTOCOL_VERSION,
    FrameHeader,
    Op,
    ShmItem,
    encode_json,
    pack_frame_header,
)
from kvpool.tiers.arena import ALIGN, Arena
from kvpool.tiers.dram import DramTier

MiB = 1 << 20
SIZES = [256 << 10, 1 * MiB, 4 * MiB, 16 * MiB]
BATCH = 8


def _label(size: int) -> str:
    return f"{size >> 10} KiB" if size < MiB else f"{size >> 20} MiB"


# -- baselines ----------------------------------------------------------------------------


def _raw_sender(port: int, size: int, count: int) -> None:
    payload = os.urandom(size)
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(count):
            s.sendall(payload)


@contextlib.contextmanager
def _peer(target: Callable[..., None], *args: Any) -> Iterator[socket.socket]:
    """The accepted end of a loopback connection whose other end is ``target(port,
    *args)`` in a spawned process (joined once the connection is closed)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        peer = mp.get_context("spawn").Process(
            target=target, args=(listener.getsockname()[1], *args))
        peer.start()
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            yield conn
        peer.join()  # it sees the connection end


def _receive(conn: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = conn.recv_into(buf[got:])
        if n == 0:
            raise RuntimeError("the raw peer closed early")
        got += n


def raw_python(size: int, budget: int) -> float:
    """GB/s of sendall -> recv_into over one loopback connection, sender in another process."""
    count = max(4, budget // size)
    buf = memoryview(bytearray(size))
    with _peer(_raw_sender, size, count) as conn:
        start = time.perf_counter()
        for _ in range(count):
            _receive(conn, buf)
        elapsed = time.perf_counter() - start
    return size * count / elapsed / 1e9


def _raw_replier(port: int, size: int) -> None:
    payload = os.urandom(size)
    request = bytearray(16)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while s.recv_into(request, 16, socket.MSG_WAITALL) == 16:
            s.sendall(payload)


def raw_request_reply(size: int, budget: int) -> float:
    """GB/s of one value a call at its floor in Python: a 16-byte request, then ``size``
    bytes back, over one loopback connection, the replier in another process (no
    parsing, no checksum: what a GET of one value a call could reach at most)."""
    count = max(4, budget // size)
    buf = memoryview(bytearray(size))
    request = bytes(16)
    with _peer(_raw_replier, size) as conn:
        start = time.perf_counter()
        for _ in range(count):
            conn.sendall(request)
            _receive(conn, buf)
        elapsed = time.perf_counter() - start
    return size * count / elapsed / 1e9


def iperf3(port: int, seconds: float) -> float:
    out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-l", "1M", "-t",
                          str(seconds), "-J"], capture_output=True, text=True, check=True,
                         timeout=seconds + 30)
    return float(json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"]) / 8e9


def redis_client(port: int) -> Any:
    """redis-py with hiredis for replies but the Python command packer (hiredis's copies)."""
    import redis
    from redis.connection import PythonRespSerializer

    class PythonPackerConnection(redis.Connection):
        def _construct_command_packer(self, packer: Any) -> Any:
            return PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)

    pool = redis.ConnectionPool(connection_class=PythonPackerConnection, host="127.0.0.1",
                                port=port)
    return redis.Redis(connection_pool=pool)


# -- measurement helpers --------------------------------------------------------------------


#: each run's sample of a series is the sum of this many blocks of its calls, spread over
#: the run (see measure_size)
BLOCKS = 8
#: the floor of one value a call: a bare Python request and reply (see raw_request_reply)
RAW_REQUEST_REPLY = "raw python request/reply"


def _block_calls(calls: int, block: int) -> int:
    """How many of ``calls`` the ``block``-th of BLOCKS blocks makes (spread evenly: a
    series of fewer calls than blocks skips every other block, not the last ones)."""
    return (block + 1) * calls // BLOCKS - block * calls // BLOCKS


def timed(fn: Callable[[], object], count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        fn()
    return time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_ms(fn: Callable[[], object], samples: int) -> dict[str, float]:
    """p50 and p99 of ``samples`` calls, in milliseconds."""
    times = []
    for _ in range(samples):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return {"p50": percentile(times, 0.5), "p99": percentile(times, 0.99)}


#: the suffix of the fast-path series that ask GET_SHM (a round trip a call), not the index
LEASED = "(GET_SHM)"
#: the suffix of the series whose sync calls run on the client's event loop
LOOP = "(loop)"
NO_POLL = "(busy_poll_us=0)"


def summary(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


# -- the benchmark ----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [s for s in SIZES if s <= args.max_size]
    budget = args.mib_per_run * MiB
    node = start_node("--dram-capacity", "1536MiB", "--max-value", "64MiB", "--no-ssd")
    redis_proc = start_redis()
    iperf_proc = start_iperf3()
    procs: list[Proc | None] = [node, redis_proc, iperf_proc]
    results: dict[str, Any] = {"sizes": {}, "runs": args.runs, "mib_per_run": args.mib_per_run}
    try:
        client = Client(node.url, pool_size=1, shm=False)
        client.connect()
        # the same calls run on the client's event loop (as every sync call did before the
        # blocking TCP path): the before/after of that path, in one run
        looped = Client(node.url, pool_size=1, shm=False, blocking=False)
        looped.connect()
        # the blocking path with no busy polling (every reply slept for, as before it)
        sleeping = Client(node.url, pool_size=1, shm=False, busy_poll_us=0)
        sleeping.connect()
        fast = Client(node.url, pool_size=1, shm=True)
        fast.connect()
        # the fast path with a request per call (GET_SHM under a lease), not the arena index
        leased = Client(node.url, pool_size=1, shm=True, shm_index=False)
        leased.connect()
        rds = redis_client(redis_proc.port) if redis_proc else None
        ceiling = [iperf3(iperf_proc.port, args.iperf_seconds) for _ in range(args.runs)] \
            if iperf_proc else []
        results["iperf3_gbps"] = summary(ceiling) if ceiling else None
        for size in sizes:
            results["sizes"][_label(size)] = measure_size(size, budget, args.runs, client, rds,
                                                          fast=fast, leased=leased,
                                                          looped=looped)
            print(f"  measured {_label(size)}", flush=True)
        pids = [node.proc.pid, *([redis_proc.proc.pid] if redis_proc else [])]
        results["latency_4kib_get_ms"] = small_latency((client, sleeping, looped), rds,
                                                       node.port, args.latency_samples)
        with on_one_cpu([os.getpid(), *pids]):
            results["latency_4kib_get_one_cpu_ms"] = small_latency(
                (client, sleeping, looped), rds, node.port, args.latency_samples)
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) > 1:
            with on_cpus({os.getpid(): cpus[0], **dict.fromkeys(pids, cpus[1])}):
                results["latency_4kib_get_split_cpus_ms"] = small_latency(
                    (client, sleeping, looped), rds, node.port, args.latency_samples)
        results["latency_1mib_get_ms"] = latency(client, rds, args.latency_samples)
        results["key_ops_512_ms"] = key_ops(client, args.latency_samples)
        client.close()
        looped.close()
        sleeping.close()
        fast.close()
        leased.close()
        results["node_stats"] = {k: v for k, v in Client(node.url).stats().items()
                                 if k in ("requests", "bytes_in", "bytes_out", "hits", "misses")}
    finally:
        for p in procs:
            if p is not None:
                p.stop()
    results["rss"] = rss_at_full_tier(args.rss_capacity_mib)
    return results


def _arena_of(values: list[bytes]) -> tuple[DramTier, ShmMapping, list[ShmItem]]:
    """``values`` stored in a DRAM tier of their own, as a node stores them, and its arena
    mapped read-only as a client maps it; where each value lies, as GET_SHM says."""
    envelopes = [seal(v) + v for v in values]
    dram = DramTier(sum(Arena.extent(len(e)) for e in envelopes))
    items = []
    for i, envelope in enumerate(envelopes):
        key = i.to_bytes(16, "big")
        if not dram.put(key, envelope):
            raise RuntimeError("copy+verify: the values do not fit their DRAM tier")
        entry = dram.peek(key)
        assert entry is not None
        items.append(ShmItem(Status.OK, entry.offset, entry.length,
                             dram.arena.gens[entry.offset // ALIGN]))
    capacity = dram.arena.capacity
    offer = {"socket": "", "capacity": capacity, "file_size": Arena.file_size(capacity)}
    return dram, ShmMapping(os.dup(dram.arena.fd), offer), items


def measure_size(size: int, budget: int, runs: int, client: Client, rds: Any, *,
                 fast: Client, leased: Client, looped: Client) -> dict[str, Any]:
    num_keys = max(BATCH, min(64, (256 * MiB) // size))
    keys = [os.urandom(16) for _ in range(num_keys)]
    # as many distinct sources as the node holds values (so both read DRAM, not cache)
    raw = [os.urandom(size) for _ in range(num_keys)]
    sources = [np.frombuffer(r, dtype=np.uint8) for r in raw]
    count = max(BATCH, budget // size)
    client.put_many(keys, raw)
    if rds is not None:
        for k, v in zip(keys, raw, strict=True):
            rds.set(k, v)
    buf = bytearray(size)
    bufs = [bytearray(size) for _ in range(BATCH)]
    # a big batch: one call moves 64 MiB (or every key the node holds), so the round trip
    # is amortised over many values and the copy rate shows
    big = max(BATCH, min(num_keys, (64 * MiB) // size))
    big_bufs = [bytearray(size) for _ in range(big)]
    big_label = f"x{big}"
    it = {"i": 0}

    def next_key() -> bytes:
        it["i"] = (it["i"] + 1) % num_keys
        return keys[it["i"]]

    def batch_keys(n: int = BATCH) -> list[bytes]:
        start = (it["i"] + n) % (num_keys - n + 1)
        it["i"] = start
        return keys[start : start + n]

    def batch_values() -> list[bytes]:
        start = it["i"]
        return [raw[(start + j) % num_keys] for j in range(BATCH)]

    ops: dict[str, Callable[[], object]] = {
        "kvpool put": lambda: client.put(next_key(), raw[it["i"]]),
        "kvpool get": lambda: client.get(next_key()),
        "kvpool get_into": lambda: client.get_into(next_key(), buf),
        f"kvpool put {LOOP}": lambda: looped.put(next_key(), raw[it["i"]]),
        f"kvpool get {LOOP}": lambda: looped.get(next_key()),
        f"kvpool get_into {LOOP}": lambda: looped.get_into(next_key(), buf),
        "kvpool put_many": lambda: client.put_many(batch_keys(), batch_values()),
        "kvpool get_many_into": lambda: client.get_many_into(batch_keys(), bufs),
        f"kvpool get_many_into {big_label}": lambda: client.get_many_into(batch_keys(big),
                                                                           big_bufs),
        "kvpool shm put": lambda: fast.put(next_key(), raw[it["i"]]),
        "kvpool shm get": lambda: fast.get(next_key()),
        "kvpool shm get_into": lambda: fast.get_into(next_key(), buf),
        "kvpool shm put_many": lambda: fast.put_many(batch_keys(), batch_values()),
        "kvpool shm get_many_into": lambda: fast.get_many_into(batch_keys(), bufs),
        f"kvpool shm get_many_into {big_label}": lambda: fast.get_many_into(batch_keys(big),
                                                                               big_bufs),
        f"kvpool shm get_into {LEASED}": lambda: leased.get_into(next_key(), buf),
        f"kvpool shm get_many_into {LEASED}": lambda: leased.get_many_into(batch_keys(), bufs),
    }
    per_call = {name: big if name.endswith(big_label) else BATCH if "many" in name else 1
                for name in ops}
    dst = np.frombuffer(buf, dtype=np.uint8)

    def memcpy() -> None:
        it["i"] = (it["i"] + 1) % num_keys
        np.copyto(dst, sources[it["i"]])

    ops["memcpy"] = memcpy
    # the same from shared memory (a memfd, like the node's arena): the fast path's own
    # ceiling where the kernel gives shmem no transparent huge pages
    fd = os.memfd_create("bench-shmem")
    os.ftruncate(fd, num_keys * size)
    shmem = mmap.mmap(fd, num_keys * size)
    os.close(fd)
    shm_src = np.frombuffer(shmem, dtype=np.uint8)
    for i in range(num_keys):
        shm_src[i * size : (i + 1) * size] = sources[i]

    def memcpy_shmem() -> None:
        it["i"] = (it["i"] + 1) % num_keys
        np.copyto(dst, shm_src[it["i"] * size : (it["i"] + 1) * size])

    ops["memcpy from shmem"] = memcpy_shmem
    # like for like: the batch's values from distinct sources into the same caller buffers
    # the batched series fill (8, or xN: too many to stay in cache, as a real load's)
    dst_sets = {"x8": [np.frombuffer(b, dtype=np.uint8) for b in bufs],
                big_label: [np.frombuffer(b, dtype=np.uint8) for b in big_bufs]}

    def memcpy_batch(dsts: list[np.ndarray[Any, Any]]) -> None:
        start = it["i"] = (it["i"] + len(dsts)) % num_keys
        for j, d in enumerate(dsts):
            np.copyto(d, sources[(start + j) % num_keys])

    for label, dsts in dst_sets.items():
        ops[f"memcpy {label}"] = functools.partial(memcpy_batch, dsts)
        per_call[f"memcpy {label}"] = len(dsts)
    # the fast path with a free round trip: the client's own copy, checksum and generation
    # check (ShmMapping.read_many, helper threads and all) from an arena-shaped memfd into
    # the same buffers -- what the batched shm series would reach if the request cost nothing
    dram, arena, items = _arena_of(raw)
    batch_sets = {"x8": [memoryview(b) for b in bufs], big_label: [memoryview(b) for b in big_bufs]}

    def copy_verify(sinks: list[memoryview]) -> None:
        start = it["i"] = (it["i"] + len(sinks)) % num_keys
        results = arena.read_many([(items[(start + j) % num_keys], sink)
                                   for j, sink in enumerate(sinks)])
        if any(status != Status.OK for status, _ in results):
            raise AssertionError("copy+verify: a value failed its checksum")

    for label, sinks in batch_sets.items():
        ops[f"copy+verify {label}"] = functools.partial(copy_verify, sinks)
        per_call[f"copy+verify {label}"] = len(sinks)
    if rds is not None:
        ops["redis set"] = lambda: rds.set(next_key(), raw[it["i"]])
        ops["redis get"] = lambda: rds.get(next_key())
    samples: dict[str, list[float]] = {name: [] for name in [*ops, "raw python",
                                                             RAW_REQUEST_REPLY]}
    calls = {name: max(1, count // per_call.get(name, 1)) for name in ops}
    for _ in range(runs):
        # a run's sample of each series is BLOCKS blocks of its calls, taken in turn with
        # every other series' blocks: the samples a ratio pairs span the same stretch of
        # the run, not two moments of it (on this VM, samples of one series taken a few
        # hundred ms apart differed by up to ~1.8x)
        elapsed = dict.fromkeys(ops, 0.0)
        for block in range(BLOCKS):
            for name, fn in ops.items():
                n = _block_calls(calls[name], block)
                if n:
                    fn()  # warm: the first call after another series' block
                    elapsed[name] += timed(fn, n)
        for name in ops:
            samples[name].append(size * per_call.get(name, 1) * calls[name]
                                 / elapsed[name] / 1e9)
        samples["raw python"].append(raw_python(size, budget))
        samples[RAW_REQUEST_REPLY].append(raw_request_reply(size, budget))
    arena.close()
    dram.close()
    # the samples too: a ratio to another series pairs the samples of one run
    out = {name: {**summary(s), "ops_per_s": statistics.median(s) * 1e9 / size, "samples": s}
           for name, s in samples.items()}
    return out


def latency(client: Client, rds: Any, samples: int) -> dict[str, Any]:
    key, value = os.urandom(16), os.urandom(MiB)
    client.put(key, value)
    buf = bytearray(MiB)
    out: dict[str, Any] = {}
    series: dict[str, Callable[[], object]] = {"kvpool get_into": lambda: client.get_into(key,
                                                                                         buf),
                                               "kvpool get": lambda: client.get(key)}
    if rds is not None:
        rds.set(key, value)
        series["redis get"] = lambda: rds.get(key)
    for name, fn in series.items():
        out[name] = latency_ms(fn, samples)
    return out


@contextlib.contextmanager
def on_one_cpu(pids: list[int]) -> Iterator[None]:
    """Every thread of ``pids`` on the first CPU this process may use, then back.

    On this 2-vCPU VM a round trip between processes on two CPUs pays two
    cross-CPU wake-ups (~35 us each); left to itself the scheduler put redis-server
    on the client's CPU and the kvpool node on the other, which alone made Redis
    4x faster at 4 KiB. Pinned alike, the systems compare on their own work."""
    cpu = min(os.sched_getaffinity(0))
    with on_cpus(dict.fromkeys(pids, cpu)):
        yield


@contextlib.contextmanager
def on_cpus(placement: dict[int, int]) -> Iterator[None]:
    """Every thread of each process of ``placement`` (pid: CPU) on its CPU, then back."""
    saved: dict[int, set[int]] = {}
    for pid, cpu in placement.items():
        for tid in map(int, os.listdir(f"/proc/{pid}/task")):
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                saved[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, {cpu})
    try:
        yield
    finally:
        for tid, cpus in saved.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)


def small_latency(clients: tuple[Client, Client, Client], rds: Any, port: int,
                  samples: int, *, rounds: int = 5) -> dict[str, Any]:
    """p50/p99 of one 4 KiB GET a call: the sync client (blocking socket, the same with
    no busy polling, and on its loop), Redis (redis-py + hiredis), and a raw Python socket
    asking the node the same GET (the floor: a request, a reply, no parsing; it sleeps for
    the reply, as redis-py does). The series take turns in ``rounds`` blocks.
    ``clients``: the sync client, the same with ``busy_poll_us=0``, and on its loop."""
    client, sleeping, looped = clients
    key, value = os.urandom(16), os.urandom(4096)
    client.put(key, value)
    series: dict[str, Callable[[], object]] = {
        "kvpool get (4 KiB)": lambda: client.get(key),
        f"kvpool get {NO_POLL} (4 KiB)": lambda: sleeping.get(key),
        f"kvpool get {LOOP} (4 KiB)": lambda: looped.get(key),
        "raw socket get (4 KiB)": _raw_get(port, key)}
    if rds is not None:
        rds.set(key, value)
        series["redis get (4 KiB)"] = lambda: rds.get(key)
    return interleaved(series, samples, rounds)


def interleaved(series: dict[str, Callable[[], object]], samples: int, rounds: int, *,
                scale: float = 1e3) -> dict[str, dict[str, float]]:
    """p50/p99 of one call of each series (seconds x ``scale``: ms by default), the series
    taking turns in ``rounds`` blocks, each block warmed by 50 calls first."""
    times: dict[str, list[float]] = {name: [] for name in series}
    for _ in range(rounds):
        for name, fn in series.items():
            for _ in range(50):
                fn()  # warm, after the other series' block
            for _ in range(max(1, samples // rounds)):
                t = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t) * scale)
    return {name: {"p50": percentile(t, 0.5), "p99": percentile(t, 0.99)}
            for name, t in times.items()}


def _raw_get(port: int, key: bytes) -> Callable[[], object]:
    """One GET frame on a plain blocking socket, read until the reply's length is in."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hello = encode_json({"protocol": PROTOCOL_VERSION, "client": "bench-raw"})
    sock.sendall(pack_frame_header(Op.HELLO, 1, 0, len(hello)) + hello)
    buf = bytearray(1 << 16)

    def exchange(frame: bytes) -> int:
        sock.sendall(frame)
        got = sock.recv_into(buf)
        while got < FRAME_HEADER_SIZE:
            got += sock.recv_into(memoryview(buf)[got:])
        need = FRAME_HEADER_SIZE + FrameHeader.unpack(buf[:FRAME_HEADER_SIZE]).body_len
        while got < need:
            got += sock.recv_into(memoryview(buf)[got:])
        return got

    exchange(b"")
    request = pack_frame_header(Op.GET, 2, 1, len(key)) + key
    return lambda: exchange(request)


def key_ops(client: Client, samples: int) -> dict[str, Any]:
    keys = [os.urandom(16) for _ in range(512)]
    client.put_many(keys, [b"x" * 64] * 512)
    out: dict[str, Any] = {}
    ops: dict[str, Callable[[], object]] = {"exists_many(512)": lambda: client.exists_many(keys),
                                            "lookup(512)": lambda: client.lookup(keys)}
    for name, fn in ops.items():
        out[name] = latency_ms(fn, samples)
    assert client.lookup(keys) == 512
    return out


def rss_at_full_tier(capacity_mib: int) -> dict[str, Any]:
    node = start_node("--dram-capacity", f"{capacity_mib}MiB", "--no-ssd")
    try:
        # over TCP: pages a fast-path client writes into the arena count in the client's
        # RSS, not the node's, which would then look far smaller than what it holds
        with Client(node.url, shm=False) as c:
            value = os.urandom(4 * MiB)
            for _ in range(int(capacity_mib * 1.5) // 4):
                c.put(os.urandom(16), value)
            stats = c.stats()
        rss = psutil.Process(node.proc.pid).memory_info().rss
    finally:
        node.stop()
    limit = capacity_mib * MiB * 1.10 + 150e6
    return {"capacity_bytes": capacity_mib * MiB, "rss_bytes": rss, "limit_bytes": limit,
            "used_bytes": stats["used_bytes"], "evictions": stats["evictions"],
            "ok": rss <= limit}


# -- report -------------------------------------------------------------------------------------


def _ratio(series: dict[str, Any], ref: dict[str, Any] | float | None) -> str:
    """``series`` over ``ref``: the median of the ratios of the samples taken in the same
    run, where both have them (a slow spell of the machine that spans a run cancels out;
    the memcpy baseline alone moved 13-22 GB/s between runs here), else of the medians."""
    if not ref:
        return ""
    if isinstance(ref, dict):
        mine, theirs = series.get("samples"), ref.get("samples")
        if mine and theirs and len(mine) == len(theirs):
            return f"{statistics.median(a / b for a, b in zip(mine, theirs, strict=True)):.2f}x"
        ref = float(ref["median"])
    return f"{series['median'] / ref:.2f}x"


def _ratio_range(series: dict[str, Any], ref: dict[str, Any] | None) -> str:
    """Like :func:`_ratio`, with the min-max of the per-run ratios."""
    if not ref:
        return ""
    pairs = [a / b for a, b in zip(series["samples"], ref["samples"], strict=True)]
    return f"{statistics.median(pairs):.2f}x [{min(pairs):.2f}-{max(pairs):.2f}]"


def _fast_refs(series: dict[str, dict[str, Any]], name: str
               ) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None]:
    """A series' like-for-like baselines: memcpy into the same buffers, and (fast path
    only) its TCP twin and its copy+verify ceiling (batched GETs)."""
    last = name.rsplit(" ", 1)[-1]
    label = last if last.startswith("x") else "x8" if "many" in name else ""
    same = series.get(f"memcpy {label}" if label else "memcpy")
    if " shm " not in name:
        return same, None, None
    tcp = series.get(name.replace("kvpool shm ", "kvpool ").removesuffix(f" {LEASED}"))
    ceiling = series.get(f"copy+verify {label}") if "get_many" in name else None
    return same, tcp, ceiling


def fast_path_markdown(results: dict[str, Any]) -> str:
    """docs/fast-path.md's table, from a results JSON: each shm GET series
    at 1 and 4 MiB against TCP, memcpy (two ways) and copy+verify."""
    lines = ["| size | series, shm | GB/s | TCP GB/s | ÷ TCP | ÷ memcpy | "
             "÷ memcpy, same buffers | ÷ copy+verify |", "|---|---|---|---|---|---|---|---|"]
    for label in ("1 MiB", "4 MiB"):
        series = results["sizes"].get(label)
        if series is None:
            continue
        for name, s in series.items():
            if not name.startswith(("kvpool shm get", "copy+verify")):
                continue
            same, tcp, ceiling = _fast_refs(series, name)
            shown = name.removeprefix("kvpool shm ")
            if tcp is None:
                shown = f"*{shown}* (no request)"
            cells = [label, shown, f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]",
                     f"{tcp['median']:.2f}" if tcp else "",
                     *(_ratio_range(s, ref) for ref in (tcp, series["memcpy"], same, ceiling))]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ratios(series: dict[str, dict[str, Any]], name: str, iperf: float | None) -> list[str]:
    """A series' ratios: to iperf3, raw Python, Redis, and (fast path) to TCP, memcpy and
    the fast path's own copy with no round trip ("copy+verify")."""
    s = series[name]
    # the same copies into the same buffers as the series (batched: many, mostly uncached)
    same, tcp, ceiling = _fast_refs(series, name)
    if name.startswith("copy+verify"):
        return ["", "", "", "", _ratio(s, series.get("memcpy")), _ratio(s, same), ""]
    if not name.startswith("kvpool"):
        return [""] * 7
    redis = series.get("redis get" if "get" in name else "redis set")
    fast = " shm " in name
    memcpy = series.get("memcpy") if fast else None
    return [_ratio(s, iperf), _ratio(s, series["raw python"]), _ratio(s, redis),
            _ratio(s, tcp), _ratio(s, memcpy), _ratio(s, same if fast else None),
            _ratio(s, ceiling)]


def report(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    iperf = results["iperf3_gbps"]["median"] if results.get("iperf3_gbps") else None
    table = Table(title="kvpool single node, 127.0.0.1 (GB/s: median \\[min-max])")
    for col in ("size", "series", "GB/s", "ops/s", "/iperf3", "/raw", "/redis", "/TCP",
                "/memcpy", "/memcpy same bufs", "/copy+verify"):
        table.add_column(col, justify="right" if col not in ("series",) else "left")
    for label, series in results["sizes"].items():
        for name, s in series.items():
            table.add_row(label, name, f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]",
                          f"{s['ops_per_s']:.0f}", *_ratios(series, name, iperf))
        table.add_section()
    console.print(table)
    if iperf:
        i = results["iperf3_gbps"]
        console.print(f"iperf3 loopback (1 stream, -l 1M): {i['median']:.2f} GB/s "
                      f"[{i['min']:.2f}-{i['max']:.2f}]")
    for name, v in _latency_rows(results).items():
        console.print(f"{name:>22}: p50 {v['p50']:.3f} ms  p99 {v['p99']:.3f} ms")
    rss = results["rss"]
    console.print(f"RSS at a full {rss['capacity_bytes'] >> 20} MiB DRAM tier: "
                  f"{rss['rss_bytes'] / MiB:.0f} MiB (limit {rss['limit_bytes'] / MiB:.0f} MiB, "
                  f"{'ok' if rss['ok'] else 'OVER'})")


def _latency_rows(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The latency rows of a results JSON by name: 4 KiB GETs as scheduled, on one CPU
    and on split CPUs (where measured), 1 MiB GETs, key ops."""
    placed = {f"{k}, {where}": v
              for key, where in (("latency_4kib_get_one_cpu_ms", "one CPU"),
                                 ("latency_4kib_get_split_cpus_ms", "split CPUs"))
              for k, v in results.get(key, {}).items()}
    return {**results.get("latency_4kib_get_ms", {}), **placed,
            **results["latency_1mib_get_ms"], **results["key_ops_512_ms"]}


def markdown(results: dict[str, Any]) -> str:
    """docs/benchmarks.md's table, from a results JSON."""
    iperf = results["iperf3_gbps"]["median"] if results.get("iperf3_gbps") else None
    lines = ["| size | series | GB/s median [min-max] | ops/s | ÷ iperf3 | ÷ raw Python "
             "| ÷ Redis | ÷ TCP | ÷ memcpy | ÷ memcpy, same buffers | ÷ copy+verify |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, series in results["sizes"].items():
        for name, s in series.items():
            cells = _ratios(series, name, iperf)
            lines.append(f"| {label} | {name} | {s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}] "
                         f"| {s['ops_per_s']:.0f} | " + " | ".join(cells) + " |")
    out = "\n".join(lines) + "\n\n"
    if iperf:
        i = results["iperf3_gbps"]
        out += (f"iperf3 loopback, one stream, `-l 1M`: **{i['median']:.2f} GB/s** "
                f"[{i['min']:.2f}-{i['max']:.2f}].\n\n")
    out += "| latency | p50 ms | p99 ms |\n|---|---|---|\n"
    for name, v in _latency_rows(results).items():
        label = name if "(" in name else f"{name} (1 MiB)"
        out += f"| {label} | {v['p50']:.3f} | {v['p99']:.3f} |\n"
    rss = results["rss"]
    out += (f"\nRSS of a node with a full {rss['capacity_bytes'] >> 20} MiB DRAM tier: "
            f"{rss['rss_bytes'] / MiB:.0f} MiB (limit capacity x 1.10 + 150 MB = "
            f"{rss['limit_bytes'] / MiB:.0f} MiB).\n")
    m = results.get("machine", {})
    out += (f"\nMeasured {m.get('when', '?')}, {m.get('cpus', '?')} CPUs, "
            f"Python {m.get('python', '?')}.\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mib-per-run", type=int, default=256, help="bytes moved per sample")
    parser.add_argument("--max-size", type=int, default=16 * MiB)
    parser.add_argument("--iperf-seconds", type=float, default=1.0)
    parser.add_argument("--latency-samples", type=int, default=500)
    parser.add_argument("--rss-capacity-mib", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("bench/results/throughput.json"))
    parser.add_argument("--quick", action="store_true", help="1 run, small budgets")
    parser.add_argument("--markdown-from", type=Path, metavar="JSON",
                        help="print docs/benchmarks.md's table of an earlier run and exit")
    parser.add_argument("--fast-path-from", type=Path, metavar="JSON",
                        help="print docs/fast-path.md's table of an earlier run and exit")
    args = parser.parse_args()
    if args.markdown_from:
        print(markdown(json.loads(args.markdown_from.read_text())))
        return
    if args.fast_path_from:
        print(fast_path_markdown(json.loads(args.fast_path_from.read_text())))
        return
    if args.quick:
        args.runs, args.mib_per_run, args.latency_samples = 1, 32, 50
        args.rss_capacity_mib, args.max_size = 64, 4 * MiB
    results = run(args)
    results["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform(), "when": time.strftime("%F %T")}
    report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
