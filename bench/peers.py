"""Saves and loads side by side with the stores a user compares kvpool with, in one run.

    python -m bench.peers                    # 9 rounds of 256 MiB a sample, ~10 min on 2 cores
    python -m bench.peers --quick            # smoke run (2 rounds of 32 MiB)
    kvpool bench peers

Every server on 127.0.0.1, each driven by a client process of its own (the same
command for each, one after another, in an order that rotates by round):

- ``kvpool``: a node (DRAM only, ``--no-ssd``) and the sync SDK over TCP (``shm=False``):
  ``put`` / ``put_many``, ``get_into`` / ``get_many_into`` into the caller's buffers;
- ``redis``: ``redis-server`` (no persistence) and redis-py with hiredis (and its Python
  command packer, faster for large values): ``set`` / ``get``, a pipeline of them for a
  call of several;
- ``lmcache``: LMCache's cache server (``python -m lmcache.v1.server``, CPU) with its own
  client (``lm://``: ``LMCServerConnector`` over ``LocalCPUBackend``'s memory objects),
  run in the engines' environment (``$VLLM_CPU_PYTHON``, with ``lmcache==0.5.6``); it
  has no batched calls, so a call of 16 is 16 of its calls;
- ``lmcache wire``: the same server read and written from a bare Python socket in LMCache's
  wire format (one ``sendmsg`` of a call's puts, ``recv_into`` the caller's buffers): the
  most a Python client gets from a Python server here, the "Python ceiling" series;
- ``mooncake``: Mooncake Store (``mooncake-transfer-engine-non-cuda``: its master with the
  HTTP metadata server, a process mounting 3 GiB, and a client mounting none, TCP
  transport): ``upsert`` / ``upsert_batch``, ``get`` / ``get_batch``; from
  ``$MOONCAKE_PYTHON`` with ``$MOONCAKE_LIB`` (libibverbs, see docs/benchmarks.md);
- ``kvpool checksum-first`` (with ``--ab``): kvpool's client hashing every value before
  sending it (no checksum trailer, as before ``PUT_FLAG_CHECKSUM_AFTER``), same node;
- ``kvpool no wake mark`` (with ``--ab``): kvpool's client receiving as bytes come (no
  ``MSG_WAITALL`` receives, no ``SO_RCVLOWAT``), to a node of its own that never sets a
  receive low-water mark either (``bench/_unmarked_node.py``): before protocol/wake.py,
  each end was woken at every segment of a value.

LMCache's PUT has no reply; its PUT samples end with a HEALTH round trip on the same
connection (the server serves a connection in order), so every sample ends once the
server holds the data. kvpool and Redis answer each call. Cells: PUT and GET of 1 and
4 MiB values, one a call and 16 a call; each sample moves ``--mib`` MiB (the same keys
every round, so a round overwrites the last), values from 64 MiB of seeded random
sources (so they are read from memory, not cache); the GETs read what the one-a-call PUTs
wrote. After the timed rounds each client reads back every key of every PUT cell and
compares it with what was written (``wrong`` in the JSON must be 0). Then 4 KiB GET
latency (p50 / p99 of ``--lat-n`` calls one at a time, or of 3 s of them). Prints GB/s
median [min-max] and kvpool's ratio to each peer (the median of per-round ratios); JSON to
``bench/results/peers.json``. A peer whose environment is not given is left out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from bench._procs import Proc, _wait_port, free_port, start_lmcache, start_node, start_redis
from bench._stats import fmt, save, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
SIZES = (1 * MiB, 4 * MiB)
PER_CALL = (1, 16)
#: bytes of distinct source values each client keeps per size
SOURCE_BYTES = 64 * MiB
#: a 4 KiB latency run stops after this many seconds (LMCache's server answers a small GET
#: in ~44 ms: its two writes of a reply meet Nagle's algorithm and a delayed ACK)
LAT_SECONDS = 3.0
#: bytes of Mooncake's segment (the storage process) and of a client's transfer buffer
MOONCAKE_SEGMENT = 3 << 30
MOONCAKE_BUFFER = 512 << 20

# -- the clients (one process per system) -------------------------------------------------


def sources(size: int) -> list[memoryview]:
    """The values a client writes for ``size``: seeded, the same in every client."""
    import numpy as np

    count = max(2, SOURCE_BYTES // size)
    blob = np.random.default_rng(size).bytes(size * count)
    view = memoryview(blob)
    return [view[i * size : (i + 1) * size] for i in range(count)]


def key_name(tag: str, i: int) -> str:
    return f"{tag}-{i}"


class Store:
    """What a client does for the benchmark; ``put`` / ``get`` take a call's items."""

    def put(self, names: list[str], values: list[memoryview]) -> None:
        raise NotImplementedError

    def get(self, names: list[str], bufs: list[memoryview]) -> None:
        """Read each into its buffer (or, where the API returns bytes, just read it)."""
        raise NotImplementedError

    def read(self, name: str, size: int) -> bytes | None:
        raise NotImplementedError

    def sync(self) -> None:
        """Return once the server holds every value put so far."""

    def close(self) -> None:
        pass


class KvpoolStore(Store):
    def __init__(self, url: str, *, checksum_first: bool = False, no_marks: bool = False
                 ) -> None:
        import xxhash

        from kvpool.client import Client, _plans, _socket
        from kvpool.protocol import wake

        if checksum_first:  # every value hashed before it is sent (no trailer)
            _plans.TRAILER_MIN = 1 << 62
        if no_marks:  # every receive taken as it comes (no MSG_WAITALL, no SO_RCVLOWAT)
            _socket._WAIT_MIN = wake.WAKE_MIN = 1 << 62

        self._hash = xxhash.xxh3_128_digest
        self._client = Client(url, shm=False)

    def _key(self, name: str) -> bytes:
        return self._hash(name.encode())

    def put(self, names: list[str], values: list[memoryview]) -> None:
        if len(names) == 1:
            self._client.put(self._key(names[0]), values[0])
        else:
            self._client.put_many([self._key(n) for n in names], values)

    def get(self, names: list[str], bufs: list[memoryview]) -> None:
        if len(names) == 1:
            got = [self._client.get_into(self._key(names[0]), bufs[0])]
        else:
            got = self._client.get_many_into([self._key(n) for n in names], bufs)
        if any(n is None for n in got):
            raise RuntimeError("kvpool: a GET missed")

    def read(self, name: str, size: int) -> bytes | None:
        value = self._client.get(self._key(name))
        return None if value is None else bytes(value)

    def close(self) -> None:
        self._client.close()


class RedisStore(Store):
    """redis-py with hiredis (and the Python command packer: hiredis's copies a large
    value); a call of several is a pipeline (no transaction)."""

    def __init__(self, port: int) -> None:
        from bench.throughput import redis_client

        self._r = redis_client(port)

    def put(self, names: list[str], values: list[memoryview]) -> None:
        if len(names) == 1:
            self._r.set(names[0], values[0])
            return
        pipe = self._r.pipeline(transaction=False)
        for name, value in zip(names, values, strict=True):
            pipe.set(name, value)
        pipe.execute()

    def get(self, names: list[str], bufs: list[memoryview]) -> None:
        if len(names) == 1:
            got = [self._r.get(names[0])]
        else:
            pipe = self._r.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            got = pipe.execute()
        if any(v is None for v in got):
            raise RuntimeError("redis: a GET missed")

    def read(self, name: str, size: int) -> bytes | None:
        value = self._r.get(name)
        return None if value is None else bytes(value)

    def close(self) -> None:
        self._r.close()


# LMCache's wire format (lmcache/v1/protocol.py, 0.5.6): a request is struct
# "iiiiiiiii150s" (command, length, fmt, dtype, location, shape[4], key), a PUT's value
# follows it; a reply is "iiiiiiiii" (code, length, fmt, dtype, shape[4], location), a
# GET's value follows it. No reply to a PUT.
_LM_REQUEST = struct.Struct("iiiiiiiii150s")
_LM_REPLY = struct.Struct("iiiiiiiii")
_LM_PUT, _LM_GET, _LM_HEALTH = 1, 2, 5
_LM_OK = 200
_LM_KV_2LTD, _LM_BF16 = 1, 3


def _digest(name: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")


def _lm_key(name: str) -> bytes:
    """A key LMCache's server parses (``CacheEngineKey.to_string``'s form)."""
    return f"bench@1@0@{_digest(name):x}@bfloat16".encode().ljust(150)


class LmWireStore(Store):
    def __init__(self, port: int) -> None:
        from kvpool.client._socket import sendmsg_all

        self._sendmsg_all = sendmsg_all
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reply = bytearray(_LM_REPLY.size)

    def put(self, names: list[str], values: list[memoryview]) -> None:
        parts: list[Any] = []
        for name, value in zip(names, values, strict=True):
            parts.append(_LM_REQUEST.pack(_LM_PUT, len(value), _LM_KV_2LTD, _LM_BF16, 0,
                                          len(value) // 2, 0, 0, 0, _lm_key(name)))
            parts.append(value)
        self._sendmsg_all(self._sock, parts)

    def _reply_head(self) -> tuple[int, int]:
        view = memoryview(self._reply)
        got = 0
        while got < len(view):
            n = self._sock.recv_into(view[got:])
            if not n:
                raise RuntimeError("LMCache server closed the connection")
            got += n
        code, length = _LM_REPLY.unpack(self._reply)[:2]
        return code, length

    def get(self, names: list[str], bufs: list[memoryview]) -> None:
        self._sock.sendall(b"".join(_LM_REQUEST.pack(_LM_GET, 0, _LM_KV_2LTD, _LM_BF16, 0,
                                                     0, 0, 0, 0, _lm_key(n)) for n in names))
        for buf in bufs:
            code, length = self._reply_head()
            if code != _LM_OK or length != len(buf):
                raise RuntimeError(f"LMCache GET: code {code}, {length} bytes")
            got = 0
            while got < length:
                n = self._sock.recv_into(buf[got:])
                if not n:
                    raise RuntimeError("LMCache server closed the connection")
                got += n

    def read(self, name: str, size: int) -> bytes | None:
        self._sock.sendall(_LM_REQUEST.pack(_LM_GET, 0, _LM_KV_2LTD, _LM_BF16, 0, 0, 0, 0,
                                            0, _lm_key(name)))
        code, length = self._reply_head()
        if code != _LM_OK:
            return None
        out = bytearray(length)
        view, got = memoryview(out), 0
        while got < length:
            got += self._sock.recv_into(view[got:])
        return bytes(out)

    def sync(self) -> None:
        self._sock.sendall(_LM_REQUEST.pack(_LM_HEALTH, 0, _LM_KV_2LTD, _LM_BF16, 0, 0, 0,
                                            0, 0, _lm_key("health")))
        self._reply_head()

    def close(self) -> None:
        self._sock.close()


class LmcacheStore(Store):
    """LMCache's own client of its server: ``LMCServerConnector`` (``lm://``) on a loop of
    its own thread, values in ``LocalCPUBackend`` memory objects, as LMCache runs it."""

    def __init__(self, port: int) -> None:
        import asyncio
        import threading

        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.storage_backend.connector import CreateConnector
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self._torch = torch
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        self._config = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=True,
                                                         max_local_cpu_size=0.5)
        self._lm_url = f"lm://127.0.0.1:{port}"
        self._by_size: dict[int, Any] = {}
        self._objs: dict[int, dict[int, Any]] = {}
        self._backend_cls, self._create = LocalCPUBackend, CreateConnector

    def _side(self, size: int) -> Any:
        """(metadata, backend, connector) for values of ``size`` bytes (one chunk each)."""
        if size not in self._by_size:
            from lmcache.v1.metadata import LMCacheMetadata

            torch = self._torch
            metadata = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1,
                                       worker_id=0, local_worker_id=0,
                                       kv_dtype=torch.bfloat16,
                                       kv_shape=(1, 2, 256, 1, size // 1024),
                                       chunk_size=256)
            backend = self._backend_cls(self._config, metadata, dst_device="cpu")
            conn = self._create(self._lm_url, self._loop, backend, self._config, metadata)
            self._by_size[size] = (metadata, backend, conn)
        return self._by_size[size]

    def _call(self, coro: Any) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(300)

    def _obj(self, size: int, value: memoryview) -> Any:
        """The memory object holding ``value`` (one per source, made on first use)."""
        objs = self._objs.setdefault(size, {})
        obj = objs.get(id(value))
        if obj is None:
            metadata, backend, _ = self._side(size)
            obj = backend.allocate(metadata.get_shapes(), metadata.get_dtypes(), None)
            memoryview(obj.byte_array).cast("B")[:] = value
            obj.ref_count_up()  # kept: each put releases one
            objs[id(value)] = obj
        return obj

    def _key(self, name: str) -> Any:
        from lmcache.utils import CacheEngineKey

        return CacheEngineKey("bench", 1, 0, _digest(name), self._torch.bfloat16)

    def put(self, names: list[str], values: list[memoryview]) -> None:
        size = len(values[0])
        conn = self._side(size)[2]
        objs = [self._obj(size, v) for v in values]
        for obj in objs:
            obj.ref_count_up()

        async def each() -> None:
            for name, obj in zip(names, objs, strict=True):
                await conn.put(self._key(name), obj)

        self._call(each())

    def get(self, names: list[str], bufs: list[memoryview]) -> None:
        conn = self._side(len(bufs[0]))[2]

        async def each() -> list[Any]:
            return [await conn.get(self._key(n)) for n in names]

        for obj in self._call(each()):
            if obj is None:
                raise RuntimeError("lmcache: a GET missed")
            obj.ref_count_down()

    def read(self, name: str, size: int) -> bytes | None:
        conn = self._side(size)[2]
        obj = self._call(conn.get(self._key(name)))
        if obj is None:
            return None
        data = bytes(memoryview(obj.byte_array).cast("B"))
        obj.ref_count_down()
        return data

    def sync(self) -> None:
        for _, _, conn in self._by_size.values():
            self._call(conn.exists(self._key("sync")))

    def close(self) -> None:
        for _, _, conn in self._by_size.values():
            self._call(conn.close())
        self._loop.call_soon_threadsafe(self._loop.stop)


class MooncakeStore(Store):
    """Mooncake Store's client (``MooncakeDistributedStore``, TCP transport) mounting no
    memory of its own: every value goes to the segment another process mounted
    (:func:`mooncake_segment`), as a client beside a storage node does. ``upsert`` /
    ``upsert_batch`` (its ``put`` keeps an existing key's value), ``get`` / ``get_batch``
    (bytes; ``b""`` is a miss)."""

    def __init__(self, address: str) -> None:
        from mooncake.store import MooncakeDistributedStore

        master, metadata = address.split(",")
        self._s = MooncakeDistributedStore()
        if self._s.setup("127.0.0.1", metadata, 0, MOONCAKE_BUFFER, "tcp", "", master) != 0:
            raise RuntimeError("Mooncake client setup failed")

    def put(self, names: list[str], values: list[memoryview]) -> None:
        code = self._s.upsert(names[0], values[0]) if len(names) == 1 else \
            self._s.upsert_batch(names, values)
        if code != 0:
            raise RuntimeError(f"mooncake: upsert returned {code}")

    def get(self, names: list[str], bufs: list[memoryview]) -> None:
        got = [self._s.get(names[0])] if len(names) == 1 else self._s.get_batch(names)
        if any(not v for v in got):
            raise RuntimeError("mooncake: a GET missed")

    def read(self, name: str, size: int) -> bytes | None:
        return self._s.get(name) or None

    def close(self) -> None:
        self._s.close()


def mooncake_segment(master: str, metadata: str, size: int) -> int:
    """The process that mounts Mooncake's memory (``size`` bytes) until stdin closes."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    if store.setup("127.0.0.1", metadata, size, MOONCAKE_BUFFER, "tcp", "", master) != 0:
        return 1
    print("ready", flush=True)
    sys.stdin.read()
    store.close()
    return 0


def open_store(system: str, address: str) -> Store:
    if system == "kvpool":
        return KvpoolStore(address)
    if system == "kvpool checksum-first":
        return KvpoolStore(address, checksum_first=True)
    if system == "kvpool no wake mark":
        return KvpoolStore(address, no_marks=True)
    if system == "redis":
        return RedisStore(int(address))
    if system == "lmcache":
        return LmcacheStore(int(address))
    if system == "lmcache wire":
        return LmWireStore(int(address))
    if system == "mooncake":
        return MooncakeStore(address)
    raise ValueError(f"unknown system {system!r}")


def client_main(system: str, address: str) -> int:
    """A client process: one JSON command a line on stdin, one JSON answer a line out.
    (This module imports no kvpool at its top: Mooncake's clients run in a python of
    their own without it.)"""
    store = open_store(system, address)
    srcs: dict[int, list[memoryview]] = {}
    bufs: dict[int, list[memoryview]] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        size, tag = cmd["size"], cmd["tag"]
        if size not in srcs:
            srcs[size] = sources(size)
            bufs[size] = [memoryview(bytearray(size)) for _ in range(max(PER_CALL))]
        src = srcs[size]
        answer: dict[str, Any] = {}
        if cmd["op"] in ("put", "get"):
            per_call, count = cmd["per_call"], cmd["count"]
            calls = [(list(range(i, min(i + per_call, count))))
                     for i in range(0, count, per_call)]
            names = [[key_name(tag, i) for i in call] for call in calls]
            t0 = time.perf_counter()
            if cmd["op"] == "put":
                for call, call_names in zip(calls, names, strict=True):
                    store.put(call_names, [src[i % len(src)] for i in call])
                store.sync()
            else:
                for call_names in names:
                    store.get(call_names, bufs[size][: len(call_names)])
            answer["seconds"] = time.perf_counter() - t0
        elif cmd["op"] == "check":
            wrong = missing = 0
            for i in range(cmd["count"]):
                value = store.read(key_name(tag, i), size)
                if value is None:
                    missing += 1
                elif value != src[i % len(src)]:
                    wrong += 1
            answer.update(wrong=wrong, missing=missing)
        elif cmd["op"] == "lat":
            store.put([key_name(tag, 0)], [src[0]])
            store.sync()
            one, buf = [key_name(tag, 0)], bufs[size][:1]
            times: list[float] = []
            stop = time.perf_counter() + LAT_SECONDS
            while len(times) < cmd["n"] and (len(times) < 20 or time.perf_counter() < stop):
                t0 = time.perf_counter()
                store.get(one, buf)
                times.append(time.perf_counter() - t0)
            times.sort()
            answer.update(p50=times[len(times) // 2], p99=times[int(len(times) * 0.99)])
        print(json.dumps(answer), flush=True)
    store.close()
    return 0


class Client:
    """A client process of one system, asked one command at a time."""

    def __init__(self, system: str, python: str, address: str, timeout: float,
                 env: dict[str, str] | None = None) -> None:
        self.system = system
        self._timeout = timeout
        self._proc = subprocess.Popen([python, "-m", "bench.peers", "--client", system,
                                       address], cwd=ROOT, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True,
                                      env={**os.environ, "LMCACHE_LOG_LEVEL": "ERROR",
                                           **(env or {})})

    def ask(self, **cmd: Any) -> dict[str, Any]:
        import selectors

        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(cmd) + "\n")
        self._proc.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            if not sel.select(self._timeout):
                self.stop()
                raise RuntimeError(f"{self.system}: no answer to {cmd} in {self._timeout}s")
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.system} client exited ({self._proc.wait(10)}) on {cmd}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def stop(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):  # (a client already gone)
                assert self._proc.stdin is not None
                self._proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self._proc.stdin.flush()
            try:
                self._proc.wait(20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)


def cells() -> Iterator[tuple[str, int, int]]:
    for op in ("put", "get"):
        for size in SIZES:
            for per_call in PER_CALL:
                yield op, size, per_call


def sample_count(size: int, mib: int) -> int:
    """Values a sample of ``size`` moves (at least one call of the most a call)."""
    return max(*PER_CALL, mib * MiB // size)


def cell_name(op: str, size: int, per_call: int) -> str:
    return f"{op} {size >> 20} MiB, {'one' if per_call == 1 else per_call} a call"


def measure(clients: dict[str, Client], rounds: int, mib: int, lat_n: int
            ) -> dict[str, Any]:
    systems = list(clients)
    gb: dict[str, dict[str, list[float]]] = {cell_name(*c): {s: [] for s in systems}
                                             for c in cells()}
    for system in systems:  # connections, allocators, sources: made before timing
        for size in SIZES:
            clients[system].ask(op="put", size=size, per_call=16, count=16, tag="warm")
            clients[system].ask(op="get", size=size, per_call=16, count=16, tag="warm")
    for r in range(rounds):
        order = systems[r % len(systems):] + systems[: r % len(systems)]
        for op, size, per_call in cells():
            count = sample_count(size, mib)
            # GETs read what the one-a-call PUTs of their size wrote
            tag = f"{size}x{per_call if op == 'put' else 1}"
            for system in order:
                seconds = clients[system].ask(op=op, size=size, per_call=per_call,
                                              count=count, tag=tag)["seconds"]
                gb[cell_name(op, size, per_call)][system].append(count * size / seconds / 1e9)
        print(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{s} {gb[cell_name('put', MiB, 1)][s][-1]:.2f}" for s in systems)
            + " GB/s (put 1 MiB, one a call)", flush=True)
    checks = {s: {"wrong": 0, "missing": 0} for s in systems}
    for op, size, per_call in cells():
        if op == "put":
            count = sample_count(size, mib)
            for system in systems:
                got = clients[system].ask(op="check", size=size, count=count,
                                          tag=f"{size}x{per_call}")
                for k in ("wrong", "missing"):
                    checks[system][k] += got[k]
    latency: dict[str, dict[str, list[float]]] = {s: {"p50": [], "p99": []} for s in systems}
    for r in range(max(3, rounds // 3)):
        for system in systems[r % len(systems):] + systems[: r % len(systems)]:
            got = clients[system].ask(op="lat", size=4096, n=lat_n, tag="lat")
            for k in ("p50", "p99"):
                latency[system][k].append(got[k])
    base = "kvpool"
    ratios = {cell: {f"kvpool / {s}": summary([a / b for a, b in zip(
        by[base], by[s], strict=True)]) for s in systems if s != base}
        for cell, by in gb.items()}
    return {"rounds": rounds, "mib_per_sample": mib, "systems": systems,
            "gb_s": {c: {s: summary(v) for s, v in by.items()} for c, by in gb.items()},
            "ratios": ratios, "checks": checks,
            "get_4k_s": {s: {k: summary(v) for k, v in d.items()} for s, d in latency.items()},
            "get_4k_p50_over_redis": summary([a / b for a, b in zip(
                latency[base]["p50"], latency["redis"]["p50"], strict=True)])
            if "redis" in latency else None}


def start_mooncake(python: str, env: dict[str, str]) -> tuple[list[Proc], str]:
    """Mooncake's master (its HTTP metadata server within) and a process mounting
    ``MOONCAKE_SEGMENT`` bytes, all on 127.0.0.1; the client address "master,metadata"."""
    where = subprocess.run([python, "-c", "import mooncake, os; print(os.path.dirname("
                            "mooncake.__file__))"], capture_output=True, text=True, env=env,
                           check=True, timeout=60).stdout.strip()
    rpc, meta, metrics = free_port(), free_port(), free_port()
    master = subprocess.Popen([os.path.join(where, "mooncake_master"), f"--rpc_port={rpc}",
                               "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
                               "--http_metadata_server_host=127.0.0.1",
                               f"--http_metadata_server_port={meta}",
                               f"--metrics_port={metrics}"], env=env, text=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [Proc(master, rpc)]
    try:
        _wait_port(rpc, master, timeout=30)
        _wait_port(meta, master, timeout=30)
        address = f"127.0.0.1:{rpc},http://127.0.0.1:{meta}/metadata"
        segment = subprocess.Popen([python, "-m", "bench.peers", "--mooncake-segment",
                                    *address.split(","), str(MOONCAKE_SEGMENT)], cwd=ROOT,
                                   env=env, text=True, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        procs.append(Proc(segment, 0))
        assert segment.stdout is not None
        if segment.stdout.readline().strip() != "ready":
            raise RuntimeError(f"Mooncake's segment did not mount (exit {segment.wait(30)})")
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return procs, address


def report(result: dict[str, Any]) -> None:
    systems: list[str] = result["systems"]
    peers = [s for s in systems if s != "kvpool"]
    print(f"\n{result['rounds']} rounds of {result['mib_per_sample']} MiB a sample, GB/s "
          "median [min-max]; kvpool / peer: median of per-round ratios\n")
    print("| cell | " + " | ".join(systems) + " | "
          + " | ".join(f"kvpool / {p}" for p in peers) + " |")
    print("|---" * (1 + len(systems) + len(peers)) + "|")
    for cell, by in result["gb_s"].items():
        print(f"| {cell} | " + " | ".join(fmt(by[s]) for s in systems) + " | "
              + " | ".join(fmt(result["ratios"][cell][f"kvpool / {p}"]) for p in peers)
              + " |")
    print("\n4 KiB GET, one at a time: p50 / p99 (ms, median of runs)\n")
    for system, d in result["get_4k_s"].items():
        print(f"- {system}: {d['p50']['median'] * 1e3:.3f} / {d['p99']['median'] * 1e3:.3f}")
    if result["get_4k_p50_over_redis"]:
        print(f"- kvpool p50 / redis p50: {fmt(result['get_4k_p50_over_redis'])}")
    print("\nread back after timing (wrong / missing values): " + ", ".join(
        f"{s} {c['wrong']}/{c['missing']}" for s, c in result["checks"].items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--mib", type=int, default=256, help="MiB each sample moves")
    parser.add_argument("--lat-n", type=int, default=2000,
                        help="4 KiB GETs a latency run times")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 32 MiB")
    parser.add_argument("--ab", action="store_true",
                        help="also kvpool with every PUT's checksum sent first (no trailer), "
                             "and kvpool to a node with no receive low-water mark: the "
                             "before/after of each in the same run")
    parser.add_argument("--python", default=os.environ.get("VLLM_CPU_PYTHON", ""),
                        help="a python with lmcache==0.5.6 for LMCache's server and client "
                             "(default $VLLM_CPU_PYTHON; without one, LMCache is left out)")
    parser.add_argument("--mooncake-python", default=os.environ.get("MOONCAKE_PYTHON", ""),
                        help="a python with mooncake-transfer-engine-non-cuda (and numpy) for "
                             "Mooncake Store (default $MOONCAKE_PYTHON; without one, "
                             "Mooncake is left out)")
    parser.add_argument("--mooncake-lib", default=os.environ.get("MOONCAKE_LIB", ""),
                        help="folders (':'-separated) with libibverbs.so.1 and libnl-3, "
                             "which Mooncake's wheel links (default $MOONCAKE_LIB)")
    parser.add_argument("--client", nargs=2, metavar=("SYSTEM", "ADDRESS"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--mooncake-segment", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        return client_main(*args.client)
    if args.mooncake_segment:
        master, metadata, size = args.mooncake_segment
        return mooncake_segment(master, metadata, int(size))
    if args.quick:
        args.rounds, args.mib, args.lat_n = 2, 32, 200
    procs: list[Proc] = []
    clients: dict[str, Client] = {}
    timeout = 300.0
    try:
        node = start_node("--no-ssd", "--dram-capacity", "3GiB")
        procs.append(node)
        clients["kvpool"] = Client("kvpool", sys.executable, node.url, timeout)
        if args.ab:
            clients["kvpool checksum-first"] = Client("kvpool checksum-first", sys.executable,
                                                      node.url, timeout)
            unmarked = start_node("--no-ssd", "--dram-capacity", "3GiB",
                                  module="bench._unmarked_node")
            procs.append(unmarked)
            clients["kvpool no wake mark"] = Client("kvpool no wake mark", sys.executable,
                                                    unmarked.url, timeout)
        redis = start_redis()
        if redis is not None:
            procs.append(redis)
            clients["redis"] = Client("redis", sys.executable, str(redis.port), timeout)
        else:
            print("redis-server not found: Redis left out", file=sys.stderr)
        lm = None
        if args.python and shutil.which(args.python):
            try:
                lm = start_lmcache(args.python)
            except RuntimeError as exc:
                print(f"LMCache's server did not start ({exc}): LMCache left out",
                      file=sys.stderr)
        else:
            print("no --python with lmcache: LMCache left out", file=sys.stderr)
        if lm is not None:
            procs.append(lm)
            clients["lmcache"] = Client("lmcache", args.python, str(lm.port), timeout)
            clients["lmcache wire"] = Client("lmcache wire", sys.executable, str(lm.port),
                                             timeout)
        if args.mooncake_python and shutil.which(args.mooncake_python):
            env = {"LD_LIBRARY_PATH": ":".join(filter(None, [
                args.mooncake_lib, os.environ.get("LD_LIBRARY_PATH", "")]))}
            try:
                mooncake, address = start_mooncake(args.mooncake_python, {**os.environ, **env})
            except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                print(f"Mooncake did not start ({exc}): Mooncake left out", file=sys.stderr)
            else:
                procs += mooncake
                clients["mooncake"] = Client("mooncake", args.mooncake_python, address,
                                             timeout, env)
        else:
            print("no --mooncake-python: Mooncake left out", file=sys.stderr)
        result = measure(clients, args.rounds, args.mib, args.lat_n)
    finally:
        for client in clients.values():
            client.stop()
        for proc in procs:
            proc.stop()
    result["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    report(result)
    print(f"written to {save('peers', result)}")
    bad = sum(c["wrong"] + c["missing"] for c in result["checks"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
