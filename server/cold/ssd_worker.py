"""The cold-tier worker: a child process that owns the RocksDB (SSD) tier and the S3 tier.

rocksdict holds the GIL for tens to hundreds of milliseconds on a large
``put`` (measured here: up to 300 ms with 16 MiB values), so RocksDB cannot
share a process with the node's event loop. The worker maps the node's DRAM
arena (an inherited memory-file descriptor) and moves chunk bytes between it
and RocksDB in place; the node and the worker exchange only small fixed-size
messages over a socketpair (``protocol/worker.py``).

SSD requests are served one at a time, in order, on the main thread. S3 work
(write-behind uploads of what was written to SSD, FETCH of chunks only S3
has, deletes, HEADs that CONFIRM a durable ack, a LIST at start-up and every
``relist_interval_s`` seconds) runs on a
pool of 4 threads, so a slow S3 never delays the SSD; FETCH replies may come
out of order. The S3 work of one key runs in the order the node sent it: a
DELETE waits for the upload queued before it (else the upload would land
after the delete and bring the chunk back), a FETCH for both. Every change to
what S3 holds (an upload, a delete, a 404, a LIST that finds other nodes'
chunks or misses deleted ones) is appended to the S3 log, which the node
reads from where it left off to mirror S3 in its index. A fetched value
waits in the worker until the node has reserved a DRAM slot of its size and
sends COPY. The worker exits when the node's end
of the socket closes, so it never outlives its node.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import socket
import struct
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvpool.protocol.worker import (
    KEY_LEN,
    REPLY,
    REQUEST,
    S3Change,
    S3Settings,
    SsdOp,
    SsdStatus,
    WorkerSettings,
)
from kvpool.server.cold.keyed_pool import KeyedPool
from kvpool.server.cold.s3_changes import S3ChangeLog
from kvpool.server.security.hardening import die_with_parent, forbid_dumps
from kvpool.tiers.rocksdb import RocksDbTier
from kvpool.tiers.s3 import S3Tier

__all__ = ["Worker", "main"]

_U64 = struct.Struct("<Q")
#: fetched S3 values waiting for the node's COPY, at most (oldest dropped first)
MAX_STAGED_BYTES = 256 << 20
#: FETCHes queued or running at once; past it a FETCH is answered MISS at once
MAX_FETCHES = 64


#: an op's reply (status, payload), or None when a pool thread will send it
_Result = tuple[int, bytes] | None


def _recv_exact(sock: socket.socket, buf: memoryview) -> bool:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            return False
        got += n
    return True


class Worker:
    """Serves the node's requests: SSD ops on this thread, S3 ops on a small pool."""

    def __init__(self, tier: RocksDbTier | None, arena: memoryview,
                 s3_settings: S3Settings | None = None, *, s3: S3Tier | None = None) -> None:
        """``tier``: the SSD tier (None: none, S3 alone is below DRAM); ``s3_settings``:
        the S3 tier to write behind to (None: none); ``s3`` an S3Tier made from them
        already (tests hand in one of their own)."""
        if s3 is None and s3_settings is not None:
            s3 = S3Tier(s3_settings.bucket, prefix=s3_settings.prefix,
                        endpoint_url=s3_settings.endpoint_url or None,
                        region=s3_settings.region or None, codec=s3_settings.codec)
        s3_settings = s3_settings or S3Settings(bucket="")
        self.tier = tier
        self.arena = arena
        self.s3 = s3
        self._send_lock = threading.Lock()
        self._sock: socket.socket | None = None
        #: S3 calls, in order for each key
        self._pool = KeyedPool(4, "kvpool-s3")
        self._s3_lock = threading.Lock()
        self._s3_pending = 0
        self._s3_max_pending = s3_settings.max_pending_bytes
        #: what S3 holds, a change a record, for the node's mirror
        self.s3_log = S3ChangeLog()
        self.s3_shed = 0
        self._staged: OrderedDict[bytes, bytes] = OrderedDict()  # fetched, not yet copied
        self._staged_bytes = 0
        self._fetches = 0  # FETCHes queued or running on the pool
        self.fetch_shed = 0
        self._relist_interval = s3_settings.relist_interval_s
        self._stop = threading.Event()
        if s3 is not None:
            s3.listener = self._s3_changed
        #: what serves each op (its arguments: request_id, key, offset, length)
        self._ops: dict[int, Callable[[int, bytes, int, int], _Result]] = {
            SsdOp.PUT: self._put, SsdOp.PUT_DURABLE: self._put_durable, SsdOp.GET: self._get,
            SsdOp.FETCH: self._fetch_op, SsdOp.COPY: self._copy,
            SsdOp.CONFIRM: self._confirm_op, SsdOp.REOPEN: self._reopen,
            SsdOp.EVICT: self._evict, SsdOp.DELETE: self._delete, SsdOp.KEYS: self._keys,
            SsdOp.S3_KEYS: self._s3_keys, SsdOp.STATS: self._stats,
        }

    # -- S3 -------------------------------------------------------------------------------

    def start_s3(self) -> None:
        if self.s3 is not None:
            threading.Thread(target=self._relist_forever, daemon=True).start()

    def _relist_forever(self) -> None:
        assert self.s3 is not None
        while not self._stop.is_set():
            self.s3.load_index()  # what it adds and drops reaches the log via _s3_changed
            self._stop.wait(self._relist_interval)

    def _s3_changed(self, key: bytes, present: bool) -> None:
        """The S3 tier's index gained or lost ``key`` (S3Tier.listener)."""
        self.s3_log.log(key, S3Change.PRESENT if present else S3Change.GONE)

    def _upload(self, key: bytes, value: bytes) -> None:
        assert self.s3 is not None
        try:
            self.s3.put(key, value)
        finally:
            with self._s3_lock:
                self._s3_pending -= len(value)

    def _upload_durable(self, request_id: int, key: bytes, value: bytes, evicted: bytes) -> None:
        assert self.s3 is not None
        if self.s3.put(key, value):
            self._reply(request_id, SsdStatus.OK, evicted)
        else:
            self._reply(request_id, SsdStatus.ERROR, b"")

    def _confirm(self, request_id: int, key: bytes) -> None:
        assert self.s3 is not None
        self._reply(request_id, SsdStatus.OK if self.s3.confirm(key) else SsdStatus.MISS, b"")

    def _confirm_durable(self, request_id: int, key: bytes, value: bytes,
                         evicted: bytes) -> None:
        """PUT_DURABLE of a key the index says S3 has: OK if a HEAD agrees, else upload."""
        assert self.s3 is not None
        if self.s3.confirm(key):
            self._reply(request_id, SsdStatus.OK, evicted)
        else:
            self._upload_durable(request_id, key, value, evicted)

    def _in_s3(self, key: bytes) -> bool:
        """S3 holds ``key`` and no S3 work on it (a delete, say) is queued or running."""
        assert self.s3 is not None
        return self.s3.contains(key) and not self._pool.busy(key)

    def _write_behind_s3(self, key: bytes, view: memoryview) -> None:
        if self.s3 is None or self._in_s3(key):
            return
        with self._s3_lock:
            if self._s3_pending + len(view) > self._s3_max_pending:
                self.s3_shed += 1
                return
            self._s3_pending += len(view)
        # a copy: the node reuses the arena slot as soon as this PUT is answered
        self._pool.submit(key, self._upload, key, bytes(view))

    def _delete_s3(self, key: bytes) -> None:
        assert self.s3 is not None
        try:
            self.s3.delete(key)
        finally:  # the node counts these records (one per DELETE), failed or not
            self.s3_log.log(key, S3Change.DELETED)

    def _fetch(self, request_id: int, key: bytes) -> None:
        try:
            self._fetch_one(request_id, key)
        finally:
            with self._s3_lock:
                self._fetches -= 1

    def _fetch_one(self, request_id: int, key: bytes) -> None:
        assert self.s3 is not None
        corrupt_before = self.s3.num_corrupt
        value = self.s3.get(key)
        if value is None:
            status = SsdStatus.CORRUPT if self.s3.num_corrupt > corrupt_before else SsdStatus.MISS
            self._reply(request_id, status, b"")
            return
        with self._s3_lock:
            old = self._staged.pop(key, None)
            self._staged_bytes += len(value) - (len(old) if old is not None else 0)
            self._staged[key] = value
            # a node that fetches and never copies cannot grow us without bound
            while self._staged_bytes > MAX_STAGED_BYTES and len(self._staged) > 1:
                _, dropped = self._staged.popitem(last=False)
                self._staged_bytes -= len(dropped)
        self._reply(request_id, SsdStatus.OK, _U64.pack(len(value)))

    # -- requests -------------------------------------------------------------------------

    def handle(self, request_id: int, op: int, key: bytes, offset: int,
               length: int) -> tuple[int, bytes] | None:
        """The reply, or None when a pool thread will send it."""
        run = self._ops.get(op)
        if run is None:
            return SsdStatus.ERROR, b""
        return run(request_id, key, offset, length)

    def _put_durable(self, request_id: int, key: bytes, offset: int, length: int) -> _Result:
        tier = self.tier
        view = self.arena[offset : offset + length]
        evicted = b""
        if tier is not None:
            tier.last_evicted = []
            tier.put(key, view)  # a full SSD does not matter here: S3 makes it durable
            evicted = b"".join(tier.last_evicted)
        if self.s3 is None:
            return SsdStatus.ERROR, b""
        # an index that says S3 has it may be stale (another node deleted it since our
        # last LIST): a durable ack asks S3 itself, and uploads if S3 lacks it
        upload = self._confirm_durable if self._in_s3(key) else self._upload_durable
        self._pool.submit(key, upload, request_id, key, bytes(view), evicted)
        return None

    def _put(self, request_id: int, key: bytes, offset: int, length: int) -> _Result:
        tier = self.tier
        if tier is None:  # S3 alone: the node sends PUT_DURABLE
            return SsdStatus.REFUSED, b""
        tier.last_evicted = []
        view = self.arena[offset : offset + length]
        ok = tier.put(key, view)
        self._write_behind_s3(key, view)
        if not ok and tier.full is not None:
            return SsdStatus.FULL, tier.full.encode()
        return (SsdStatus.OK if ok else SsdStatus.REFUSED), b"".join(tier.last_evicted)

    def _get(self, request_id: int, key: bytes, offset: int, length: int) -> _Result:
        tier = self.tier
        if tier is None:
            return SsdStatus.MISS, b""
        corrupt_before = tier.num_corrupt
        value = tier.get(key)
        if value is None:
            return (SsdStatus.CORRUPT if tier.num_corrupt > corrupt_before
                    else SsdStatus.MISS), b""
        return self._into_arena(value, offset, length)

    def _fetch_op(self, request_id: int, key: bytes, offset: int, length: int) -> _Result:
        if self.s3 is None:
            return SsdStatus.MISS, b""
        with self._s3_lock:
            if self._fetches >= MAX_FETCHES:  # a flood of misses: answer, do not queue
                self.fetch_shed += 1
                return SsdStatus.MISS, b""
            self._fetches += 1
        self._pool.submit(key, self._fetch, request_id, key)
        return None

    def _copy(self, request_id: int, key: bytes, offset: int, length: int) -> _Result:
        with self._s3_lock:
            value = self._staged.pop(key, None)
            if value is not None:
                self._staged_bytes -= len(value)
        if value is None:
            return SsdStatus.MISS, b""
        return self._into_arena(value, offset, length)

    def _into_arena(self, value: bytes, offset: int, length: int) -> _Result:
        """``value`` into the slot the node reserved (SIZE if it is not the slot's size)."""
        if len(value) != length:
            return SsdStatus.SIZE, b""
        self.arena[offset : offset + length] = value
        return SsdStatus.OK, b""

    def _confirm_op(self, request_id: int, key: bytes, offset: int, length: int) -> _Result:
        if self.s3 is None:
            return SsdStatus.MISS, b""
        self._pool.submit(key, self._confirm, request_id, key)
        return None

    def _reopen(self, request_id: int, key: bytes, offset: int, length: int) -> _Result:
        if self.tier is None or self.tier.reopen():
            return SsdStatus.OK, b""
        return SsdStatus.FULL, (self.tier.full or "").encode()

    def _evict(self, request_id: int, key: bytes, offset: int, length: int) -> _Result:
        found = self.tier is not None and self.tier.delete(key)
        return (SsdStatus.OK if found else SsdStatus.MISS), b""

    def _delete(self, request_id: int, key: bytes, offset: int, length: int) -> _Result:
        found = self.tier is not None and self.tier.delete(key)
        if self.s3 is not None:
            self._pool.submit(key, self._delete_s3, key)
        return (SsdStatus.OK if found else SsdStatus.MISS), b""

    def _keys(self, request_id: int, key: bytes, offset: int, length: int) -> _Result:
        lens = self.tier.value_lens() if self.tier is not None else {}
        return SsdStatus.OK, b"".join(KEY_LEN.pack(k, n) for k, n in lens.items())

    def _s3_keys(self, request_id: int, key: bytes, offset: int, length: int) -> _Result:
        """S3 log records from record ``offset`` on (the first the node has not applied:
        the ones before it are done with)."""
        return SsdStatus.OK, self.s3_log.page(offset)

    def _stats(self, request_id: int, key: bytes, offset: int, length: int) -> _Result:
        tier = self.tier
        stats: dict[str, Any] = {}
        if tier is not None:
            stats.update(tier.stats().to_dict(), corrupt=tier.num_corrupt, full=tier.full)
        if self.s3 is not None:
            s3 = self.s3.stats().to_dict()
            s3.update(errors=self.s3.num_errors, corrupt=self.s3.num_corrupt,
                      last_error=self.s3.last_error, shed=self.s3_shed,
                      pending_bytes=self._s3_pending, fetches=self._fetches,
                      fetch_shed=self.fetch_shed, staged_bytes=self._staged_bytes)
            stats["s3"] = s3
        return SsdStatus.OK, json.dumps(stats).encode()

    def _reply(self, request_id: int, status: int, payload: bytes) -> None:
        assert self._sock is not None
        with self._send_lock:  # pool threads reply too
            self._sock.sendall(REPLY.pack(request_id, status, len(payload)) + payload)

    def serve(self, sock: socket.socket) -> None:
        self._sock = sock
        header = memoryview(bytearray(REQUEST.size))
        try:
            while _recv_exact(sock, header):
                op, request_id, key, offset, length = REQUEST.unpack(header)
                try:
                    result = self.handle(request_id, op, key, offset, length)
                except Exception as exc:  # keep serving; the node counts the error
                    print(f"kvpool ssd worker: {type(exc).__name__}: {exc}", file=sys.stderr)
                    result = SsdStatus.ERROR, b""
                if result is not None:
                    self._reply(request_id, *result)
        finally:
            self._stop.set()
            self._pool.shutdown()


def main(argv: list[str] | None = None) -> int:
    """The worker's process: the node passes the process's plumbing on the command line
    and its :class:`WorkerSettings` on stdin (``protocol/worker.py``)."""
    parser = argparse.ArgumentParser(prog="kvpool-ssd-worker")
    parser.add_argument("--path", required=True, help="the RocksDB directory")
    parser.add_argument("--arena-fd", type=int, required=True)
    parser.add_argument("--arena-size", type=int, required=True)
    parser.add_argument("--sock-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, default=0,
                        help="exit when this process (the node) dies")
    args = parser.parse_args(argv)
    # Ctrl-C in a terminal reaches the whole process group, and a service manager's stop
    # (systemd's default KillMode, `timeout`) sends SIGTERM to every process of the unit:
    # the node shuts down on either and closes the socket once its queued work is sent,
    # and this process exits at that EOF (or with the node, die_with_parent). Dying at the
    # signal itself printed a KeyboardInterrupt traceback into the node's log at every
    # Ctrl-C; at SIGTERM it lost the write-behinds still queued and the node logged an
    # ERROR ("SSD worker connection lost") at every stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    settings = WorkerSettings.decode(sys.stdin.buffer.read())
    if settings.no_dumps:
        forbid_dumps()
    os.nice(settings.nice)
    sock = socket.socket(fileno=args.sock_fd)
    arena_map = mmap.mmap(args.arena_fd, args.arena_size)
    os.close(args.arena_fd)
    tier = None
    if settings.policy.ssd:
        try:
            tier = RocksDbTier(args.path, settings.capacity_bytes, codec=settings.codec,
                               write_buffer_bytes=settings.write_buffer_bytes)
        except Exception as exc:
            print(f"kvpool ssd worker: cannot open {args.path}: {exc}", file=sys.stderr)
            return 2
    arena = memoryview(arena_map)
    worker = Worker(tier, arena, settings.s3)
    worker.start_s3()
    try:
        worker.serve(sock)
    finally:
        if tier is not None:
            tier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
