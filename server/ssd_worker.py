"""The SSD worker: a child process that owns the RocksDB tier.

rocksdict holds the GIL for tens to hundreds of milliseconds on a large
``put`` (measured here: up to 300 ms with 16 MiB values), so RocksDB cannot
share a process with the node's event loop. The worker maps the node's DRAM
arena (an inherited memory-file descriptor) and moves chunk bytes between it
and RocksDB in place; the node and the worker exchange only small fixed-size
messages over a socketpair:

    request  (40 bytes)  op u8 | 3 pad | request_id u32 | key 16 | offset u64 | length u64
    reply    (16 bytes)  request_id u32 | status u8 | 3 pad | length u64, then ``length``
                         payload bytes for KEYS (n x (key 16 | value_len u64)),
                         STATS (JSON) and PUT (n x 16-byte keys it evicted)

Requests are served one at a time, in order. The worker exits when the node's
end of the socket closes, so it never outlives its node.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import sys
from typing import Any

from kvpool.protocol.envelope import Codec
from kvpool.server.ssd_messages import KEY_LEN, REPLY, REQUEST, SsdOp, SsdStatus
from kvpool.tiers.rocksdb import RocksDbTier

__all__ = ["Worker", "main"]


def _recv_exact(sock: socket.socket, buf: memoryview) -> bool:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            return False
        got += n
    return True


class Worker:
    def __init__(self, tier: RocksDbTier, arena: memoryview) -> None:
        self.tier = tier
        self.arena = arena

    def handle(self, op: int, key: bytes, offset: int, length: int) -> tuple[int, bytes]:
        tier = self.tier
        if op == SsdOp.PUT:
            tier.last_evicted = []
            ok = tier.put(key, self.arena[offset : offset + length])
            if not ok and tier.full is not None:
                return SsdStatus.FULL, tier.full.encode()
            return (SsdStatus.OK if ok else SsdStatus.REFUSED), b"".join(tier.last_evicted)
        if op == SsdOp.GET:
            corrupt_before = tier.num_corrupt
            value = tier.get(key)
            if value is None:
                return (SsdStatus.CORRUPT if tier.num_corrupt > corrupt_before
                        else SsdStatus.MISS), b""
            if len(value) != length:
                return SsdStatus.SIZE, b""
            self.arena[offset : offset + length] = value
            return SsdStatus.OK, b""
        if op == SsdOp.DELETE:
            return (SsdStatus.OK if tier.delete(key) else SsdStatus.MISS), b""
        if op == SsdOp.KEYS:
            return SsdStatus.OK, b"".join(KEY_LEN.pack(k, n)
                                          for k, n in tier.value_lens().items())
        if op == SsdOp.STATS:
            stats: dict[str, Any] = tier.stats().to_dict()
            stats["corrupt"] = tier.num_corrupt
            stats["full"] = tier.full
            return SsdStatus.OK, json.dumps(stats).encode()
        return SsdStatus.ERROR, b""

    def serve(self, sock: socket.socket) -> None:
        header = memoryview(bytearray(REQUEST.size))
        while _recv_exact(sock, header):
            op, request_id, key, offset, length = REQUEST.unpack(header)
            try:
                status, payload = self.handle(op, key, offset, length)
            except Exception as exc:  # keep serving; the node counts the error
                print(f"kvpool ssd worker: {type(exc).__name__}: {exc}", file=sys.stderr)
                status, payload = SsdStatus.ERROR, b""
            sock.sendall(REPLY.pack(request_id, status, len(payload)) + payload)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool-ssd-worker")
    parser.add_argument("--path", required=True)
    parser.add_argument("--capacity", type=int, required=True)
    parser.add_argument("--codec", type=int, default=int(Codec.LZ4))
    parser.add_argument("--write-buffer", type=int, default=64 << 20)
    parser.add_argument("--arena-fd", type=int, required=True)
    parser.add_argument("--arena-size", type=int, required=True)
    parser.add_argument("--sock-fd", type=int, required=True)
    parser.add_argument("--nice", type=int, default=5)
    args = parser.parse_args(argv)
    # background work: on a busy machine the node's event loop should win the CPU
    os.nice(args.nice)
    sock = socket.socket(fileno=args.sock_fd)
    arena_map = mmap.mmap(args.arena_fd, args.arena_size)
    os.close(args.arena_fd)
    try:
        tier = RocksDbTier(args.path, args.capacity, codec=Codec(args.codec),
                           write_buffer_bytes=args.write_buffer)
    except Exception as exc:
        print(f"kvpool ssd worker: cannot open {args.path}: {exc}", file=sys.stderr)
        return 2
    arena = memoryview(arena_map)
    try:
        Worker(tier, arena).serve(sock)
    finally:
        tier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
