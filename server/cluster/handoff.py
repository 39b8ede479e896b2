"""Drain: hand this node's DRAM-resident chunks to their new owners, then leave the map.

Runs when the map says this node is ``draining`` (it owns nothing any more).
Chunks go out in batches through the SDK, routed by the current map, at a
bounded rate; chunks with a TTL keep it. Clients that miss on a new owner
meanwhile also ask draining nodes, so a move costs no recompute. When
every chunk has been offered, the node removes itself from the map (etcd)
and can be stopped. The SSD and S3 tiers are not moved: S3 is shared, and
SSD-only chunks are refilled lazily from S3 by their new owners.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvpool.client import AsyncClient
from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE, Codec, EnvelopeHeader
from kvpool.protocol.errors import CorruptChunkError, KvpoolError
from kvpool.tiers.dram import DramTier, Entry

__all__ = ["Handoff", "HandoffProgress"]

log = logging.getLogger("kvpool.server")

BATCH = 32


@dataclass
class HandoffProgress:
    state: str = "idle"  #: idle, running, done, failed
    chunks_total: int = 0
    chunks_moved: int = 0
    chunks_skipped: int = 0  #: gone before their turn (evicted, expired, deleted)
    chunks_failed: int = 0
    bytes_moved: int = 0
    started_at: float = 0.0
    finished_at: float = 0.0
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Handoff:
    def __init__(self, dram: DramTier, seed: str, *, rate_bytes_s: int,
                 leave: Callable[[], Awaitable[object]],
                 client_options: dict[str, Any] | None = None) -> None:
        self.dram = dram
        #: token, scope ("raw": stored keys go over verbatim) and TLS of the hand-off client
        self.client_options = client_options or {}
        self.seed = seed
        self.rate_bytes_s = rate_bytes_s
        self.leave = leave
        self.progress = HandoffProgress()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        p = self.progress = HandoffProgress(state="running", started_at=time.time())
        keys = self.dram.keys()
        p.chunks_total = len(keys)
        log.info("draining: handing %d DRAM chunks to their new owners", len(keys))
        try:
            async with AsyncClient(self.seed, client_name="kvpool-handoff", shm=False,
                                   **self.client_options) as client:
                t0 = time.monotonic()
                for start in range(0, len(keys), BATCH):
                    await self._move(client, keys[start : start + BATCH])
                    # bounded rate: sleep until the bytes sent so far fit the budget
                    ahead = p.bytes_moved / self.rate_bytes_s - (time.monotonic() - t0)
                    if ahead > 0:
                        await asyncio.sleep(ahead)
            await self.leave()
        except (KvpoolError, OSError) as exc:
            p.state, p.error = "failed", f"{type(exc).__name__}: {exc}"
            log.error("drain hand-off failed: %s", p.error)
            return
        finally:
            p.finished_at = time.time()
        p.state = "done"
        log.info("drained: %d chunks moved, %d gone before their turn, %d failed; this node "
                 "has left the map and can be stopped", p.chunks_moved, p.chunks_skipped,
                 p.chunks_failed)

    async def _move(self, client: AsyncClient, keys: list[bytes]) -> None:
        p = self.progress
        entries = self.dram.acquire_many(keys)
        held = [e for e in entries if e is not None]
        p.chunks_skipped += len(keys) - len(held)
        try:
            groups: dict[tuple[float | None, int, bytes], list[tuple[Entry, memoryview,
                                                                      EnvelopeHeader]]] = {}
            now = time.monotonic()
            for entry in held:
                value = self.dram.view(entry)
                try:
                    header = EnvelopeHeader.unpack(value)
                except CorruptChunkError:
                    header = None
                if header is None or header.codec != Codec.RAW:
                    p.chunks_failed += 1  # DRAM holds raw envelopes only; this one is damaged
                    continue
                ttl = None if entry.expires_at is None else max(0.001, entry.expires_at - now)
                groups.setdefault((ttl, header.num_tokens, header.fingerprint), []).append(
                    (entry, value[ENVELOPE_HEADER_SIZE:], header))
            for (ttl, num_tokens, fingerprint), items in groups.items():
                try:
                    await client.put_many([e.key for e, _, _ in items], [v for _, v, _ in items],
                                          ttl=ttl, chunk_indexes=[h.chunk_index for *_, h in items],
                                          num_tokens=num_tokens, fingerprint=fingerprint,
                                          parents=[e.parent for e, _, _ in items])
                except KvpoolError as exc:
                    failed = getattr(exc, "failed_keys", None)
                    lost = len(failed) if failed else len(items)
                    p.chunks_failed += lost
                    p.chunks_moved += len(items) - lost
                    log.warning("drain: %d chunks not handed off: %s", lost, exc)
                    continue
                p.chunks_moved += len(items)
                p.bytes_moved += sum(len(v) for _, v, _ in items)
        finally:
            for entry in held:
                self.dram.release(entry)
