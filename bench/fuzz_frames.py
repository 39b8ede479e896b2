"""Coverage-guided fuzzing of a node's data path with atheris (``pip install 'kvpool[fuzz]'``).

Each input is one client connection to an in-process node (the real
NodeConnection, request parser, handlers and DRAM tier; no sockets): the
first byte picks how the rest is split into reads (1 byte to 64 KiB), and
a valid HELLO is prepended unless the second byte is odd, and its bit 1
treats the connection as granted the shared-memory arena for writing (so
GET_SHM, PUT_SHM and COMMIT reach their handlers). After the connection
closes, the harness checks what a hostile client must never do:

- raise out of the node's callbacks (a crash),
- leave DRAM reserved after its connection is gone (a leak: unbounded
  allocation over many connections),
- make a stored witness chunk unreadable or different,
- leave a fast-path lease (read or write) open.

Run: ``python -m bench.fuzz_frames -atheris_runs=200000`` (libFuzzer
flags pass through; ``-max_total_time=600`` bounds it by time). A seed corpus
of valid frames is written to ``~/.cache/kvpool/fuzz-corpus`` (or under
``$KVPOOL_CACHE_DIR``) on first use, and the corpus grows there. The
hypothesis test ``tests/server/test_hostile.py`` does the same against a node process.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

from kvpool.protocol.envelope import seal
from kvpool.protocol.frames import Op, PutItemHeader, encode_frame, encode_json
from kvpool.protocol.parsers import Limits
from kvpool.server.admin.events import EventBus
from kvpool.server.cold.base import NoColdTier
from kvpool.server.cold.tiering import TierManager
from kvpool.server.data.connection import NodeConnection
from kvpool.server.data.handlers import Handlers
from kvpool.server.data.shm import ShmService
from kvpool.server.data.stats import NodeStats
from kvpool.tiers.dram import DramTier

HELLO = b"".join(encode_frame(Op.HELLO, 1, [encode_json({"protocol": 1})]))
WITNESS_KEY = b"w" * 16
WITNESS = seal(b"witness" * 100) + b"witness" * 100


class Transport(asyncio.Transport):
    """Collects replies; enough of a transport for NodeConnection."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False
        self.bytes_out = 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("fuzz", 0) if name == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def writelines(self, data: Any) -> None:
        self.bytes_out += sum(memoryview(b).nbytes for b in data)

    def write(self, data: Any) -> None:
        self.bytes_out += memoryview(data).nbytes

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def seed_corpus() -> list[bytes]:
    value = seal(b"p" * 300) + b"p" * 300
    frames = [
        encode_frame(Op.PUT, 2, [PutItemHeader(b"f" * 16, len(value)).pack(), value], count=1),
        encode_frame(Op.GET, 3, [b"f" * 16, b"g" * 16], count=2),
        encode_frame(Op.LOOKUP, 4, [b"f" * 16], count=1),
        encode_frame(Op.EXISTS, 5, [b"f" * 16], count=1),
        encode_frame(Op.PIN, 6, [b"f" * 16], count=1),
        encode_frame(Op.UNPIN, 6, [b"f" * 16], count=1),
        encode_frame(Op.DELETE, 6, [b"f" * 16], count=1),
        encode_frame(Op.STATS, 7, []),
        encode_frame(Op.CLUSTER, 7, []),
        encode_frame(Op.RELEASE, 8, [bytes(8)], count=1),
        # PUT through the arena: reserve, then commit lease 1 (flag byte bit 1 grants writes)
        [*encode_frame(Op.PUT_SHM, 9, [PutItemHeader(b"s" * 16, len(value)).pack()],
                       count=1),
         *encode_frame(Op.COMMIT, 10, [(1).to_bytes(8, "little")], count=1)],
    ]
    return [bytes([split, flags]) + b"".join(f) for split in (0, 7, 200) for flags in (0, 2)
            for f in frames]


class Harness:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.dram = DramTier(8 << 20)
        # the fast path's leases (never started: no socket; sessions are granted by flag)
        self.shm = ShmService(self.dram, lease_s=5.0)
        self.handlers = Handlers("fuzz", TierManager(self.dram, NoColdTier(), EventBus("fuzz")),
                                 Limits(4 << 20, 64, 1 << 20), NodeStats(), shm=self.shm)
        self.registry: set[NodeConnection] = set()
        self.runs = 0
        assert self.dram.put(WITNESS_KEY, WITNESS)
        self.dram.pin_many([WITNESS_KEY], True)

    def one_input(self, data: bytes) -> None:
        self.loop.run_until_complete(self._connection(data))
        self.runs += 1

    async def _connection(self, data: bytes) -> None:
        if len(data) < 2:
            return
        step = 1 + (data[0] * 257) % (64 << 10)
        stream = (b"" if data[1] & 1 else HELLO) + data[2:]
        conn = NodeConnection(self.handlers, self.registry, idle_timeout_s=0.0)
        transport = Transport()
        conn.connection_made(transport)
        if data[1] & 2:  # as if granted the arena for writing (GET_SHM, PUT_SHM, COMMIT)
            conn._session.shm = conn._session.write = True
        for start in range(0, len(stream), step):
            if transport.closed:
                break
            piece = stream[start : start + step]
            while piece and not transport.closed:
                buf = conn.get_buffer(len(piece))
                n = min(len(buf), len(piece))
                buf[:n] = piece[:n]
                conn.buffer_updated(n)
                piece = piece[n:]
        await asyncio.sleep(0)  # let replies that waited on a task finish
        conn.connection_lost(None)
        self._check()

    def _check(self) -> None:
        stats = self.dram.stats()
        slack = 4096 * stats.num_objects  # each value's page rounding
        if stats.allocated_bytes > stats.used_bytes + slack:
            raise AssertionError(f"DRAM leaked: {stats.allocated_bytes} bytes allocated for "
                                 f"{stats.used_bytes} stored in {stats.num_objects} chunks")
        if self.dram.get(WITNESS_KEY) != WITNESS:
            raise AssertionError("the witness chunk changed or vanished")
        if self.registry:
            raise AssertionError("a closed connection is still registered")
        if self.shm.open_leases:
            raise AssertionError(f"{self.shm.open_leases} leases outlived their connection")


def main() -> None:
    import atheris  # type: ignore[import-untyped,import-not-found,unused-ignore]

    logging.disable(logging.CRITICAL)  # every refused connection logs a line otherwise
    cache = os.environ.get("KVPOOL_CACHE_DIR") or Path.home() / ".cache" / "kvpool"
    corpus = Path(cache) / "fuzz-corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for seed in seed_corpus():  # new seeds join a corpus grown by earlier runs
        path = corpus / f"seed-{hashlib.sha1(seed).hexdigest()[:16]}"
        if not path.exists():
            path.write_bytes(seed)
    harness = Harness()
    atheris.instrument_all()  # coverage of everything imported: the parser, handlers, tier
    argv = [*sys.argv, str(corpus)] if not any(os.path.isdir(a) for a in sys.argv[1:]) \
        else sys.argv
    # libFuzzer reports runs, coverage and corpus size itself, and exits from C when done
    atheris.Setup(argv, harness.one_input)
    atheris.Fuzz()

if __name__ == "__main__":
    main()
