"""The node's handle on its cold tier (the SSD, S3 below it, or S3 alone right below
DRAM): the worker process (``worker_process.py``) as the data path sees it.

Keeps the index the data path needs without any I/O: which keys are on SSD
and the length of each RAW envelope (a DRAM slot is reserved with it before
a promotion). The index is loaded from the worker at start-up (rebuilt by
RocksDB from its metadata) and kept current from the replies: a PUT reply
names the keys the worker evicted, a GET that misses or finds a corrupt
value drops the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvpool.protocol.envelope import CODEC_NAMES, Codec
from kvpool.protocol.worker import (
    S3_LOG_PAGE,
    SsdOp,
    SsdStatus,
    WorkerSettings,
    decode_keys,
)
from kvpool.server.cold.base import ColdCounters, QueuedWrites
from kvpool.server.cold.s3_mirror import S3KeyMirror
from kvpool.server.cold.worker_channel import SsdUnavailableError
from kvpool.server.cold.worker_process import WorkerProcess
from kvpool.tiers.events import TierEvents
from kvpool.tiers.tenants import TenantChunks

__all__ = ["SsdTier", "SsdUnavailableError"]

_U64 = struct.Struct("<Q")

log = logging.getLogger("kvpool.server.cold.ssd")


class FullDisk:
    """Whether the SSD takes writes: once the worker reports its disk full, the tier
    serves what it holds and sheds writes, and asks the worker every ``retry_s`` to take
    them again (``reopen``)."""

    def __init__(self, path: Path, retry_s: float,
                 reopen: Callable[[], Awaitable[tuple[int, bytes]]],
                 counters: ColdCounters) -> None:
        self.path = path
        self.retry_s = retry_s
        self._reopen = reopen
        self._counters = counters
        #: why the disk refuses writes (None: it takes them)
        self.why: str | None = None
        self._task: asyncio.Task[None] | None = None

    def mark(self, why: str) -> None:
        if self.why is not None:
            return
        self.why = why
        log.error("SSD tier at %s is full (%s): it serves the chunks it holds and refuses "
                  "writes; it tries again every %gs", self.path, why, self.retry_s)
        self._task = asyncio.create_task(self._retry())

    async def _retry(self) -> None:
        while self.why is not None:
            await asyncio.sleep(self.retry_s)
            try:
                status, why = await self._reopen()
            except SsdUnavailableError:
                return
            if status == SsdStatus.OK:
                log.warning("SSD tier at %s takes writes again", self.path)
                self.why = None
                self._counters.recovered += 1
            else:
                self.why = why.decode(errors="replace")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class SsdTier:
    """The worker's tiers as the data path sees them, with no I/O: which keys the SSD
    holds (and each one's length), which S3 holds (:class:`S3KeyMirror`), the
    write-behinds in flight and the tenants' SSD bytes."""

    def __init__(self, path: Path, settings: WorkerSettings, *, arena_fd: int,
                 arena_size: int, max_pending_bytes: int, start_timeout_s: float = 60.0,
                 s3_poll_s: float = 1.0, full_retry_s: float = 10.0) -> None:
        """``settings``: what the worker runs (the SSD tier, and S3 below it or not), sent
        to it as it starts."""
        self.path = path
        self.settings = settings
        #: keys the worker knows to be in S3 (its writes, its LISTs), mirrored every s3_poll_s
        self.s3_index = S3KeyMirror()
        #: each key the SSD dropped to make room (its capacity, a tenant's quota)
        self.events = TierEvents("ssd")
        self._s3_poll_s = s3_poll_s
        self._s3_task: asyncio.Task[None] | None = None
        self.start_timeout_s = start_timeout_s
        self.max_pending_bytes = max_pending_bytes
        self.index: dict[bytes, int] = {}
        #: the chunks this node wrote for each tenant with a quota (chunks found on disk at
        #: start-up belong to no one: the tier forgot who wrote them)
        self._quotas = TenantChunks()
        #: SSD bytes of each tenant with a quota (its chunks on disk), and the quotas
        self.tenants = self._quotas.tenants
        #: write-behinds queued per key, and how many of them a DELETE overtook (the worker
        #: serves SSD requests in order: those complete first and must not be indexed)
        self._writing = QueuedWrites()
        self.counters = ColdCounters()
        self._worker = WorkerProcess(path, settings, arena_fd=arena_fd,
                                     arena_size=arena_size, on_lost=self._lost)
        self.up = False
        #: a full disk: writes shed until the worker takes them again
        self.disk = FullDisk(path, full_retry_s, lambda: self._call(SsdOp.REOPEN),
                             self.counters)

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the worker and load its index; SsdUnavailableError if it cannot start."""
        if self.has_ssd:
            self.path.mkdir(parents=True, exist_ok=True)
        await self._worker.spawn()
        self.up = True
        try:
            async with asyncio.timeout(self.start_timeout_s):
                _, payload = await self._call(SsdOp.KEYS)
        except (SsdUnavailableError, TimeoutError) as exc:
            why = str(exc) or type(exc).__name__
            await self.stop()  # the worker has exited after this: its stderr is complete
            why = await self._worker.stderr_text() or why
            raise SsdUnavailableError(f"SSD tier at {self.path} did not start: {why}") from exc
        self.index = decode_keys(payload)
        status, reason = await self._call(SsdOp.REOPEN)
        if status == SsdStatus.FULL:  # a full disk at start: its chunks are served read-only
            self.disk.mark(reason.decode(errors="replace"))
        self._worker.forward_stderr()
        if self.has_s3:
            self._s3_task = asyncio.create_task(self._poll_s3_keys())

    async def _poll_s3_keys(self) -> None:
        while self.up:
            with contextlib.suppress(SsdUnavailableError):
                await self.refresh_s3_index()
            await asyncio.sleep(self._s3_poll_s)

    async def refresh_s3_index(self) -> None:
        """Apply the changes to what S3 holds that the worker logged since the last call."""
        while True:
            _, payload = await self._call(SsdOp.S3_KEYS, offset=self.s3_index.log_pos)
            if self.s3_index.apply(payload) < S3_LOG_PAGE:
                return

    async def stop(self) -> None:
        self.up = False
        await self._worker.stop()
        await self.disk.stop()
        if self._s3_task is not None:
            self._s3_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._s3_task

    # -- operations -----------------------------------------------------------------------

    @property
    def full(self) -> str | None:
        """Why the disk refuses writes (None: it takes them)."""
        return self.disk.why

    @property
    def capacity_bytes(self) -> int:
        return self.settings.capacity_bytes

    @property
    def codec(self) -> Codec:
        return self.settings.codec

    @property
    def has_s3(self) -> bool:
        return self.settings.s3 is not None

    @property
    def has_ssd(self) -> bool:
        """False: S3 alone is below DRAM (every write is an upload; :attr:`index` stays
        empty)."""
        return self.settings.policy.ssd

    def write(self, key: bytes, offset: int, length: int,
              on_done: Callable[[bool], object], *, durable: bool = False,
              tenant: str | None = None) -> bool:
        """Queue a write-behind of arena[offset:offset+length] under ``key``.

        Returns False, counting a shed write, when the worker is down or the
        pending budget is spent: a cache drops work rather than block or grow.
        Otherwise the caller keeps that memory alive until ``on_done(stored)`` runs.
        ``durable``: also upload to S3 before answering; ``stored`` then means "in S3"
        (always so without an SSD tier).
        """
        durable = durable or not self.has_ssd
        c = self.counters
        if not self.up or self.full is not None or \
                c.pending_write_bytes + length > self.max_pending_bytes:
            c.shed += 1
            return False
        if self.has_ssd and self._quotas.limits(tenant):
            assert tenant is not None
            victims = self._quotas.victims(tenant, length)
            if victims is None:
                c.shed += 1
                return False
            for victim in victims:  # the tenant's oldest SSD chunks (S3 keeps them)
                self.evict(victim)
            self.tenants.evictions += len(victims)
            self._quotas.queue(tenant, length)
        c.pending_writes += 1
        c.pending_write_bytes += length
        self._writing.queue(key)
        future = self._call(SsdOp.PUT_DURABLE if durable else SsdOp.PUT, key, offset, length)
        future.add_done_callback(lambda f: self._written(f, key, length, on_done,
                                                         durable=durable, tenant=tenant))
        return True

    async def confirm(self, key: bytes) -> bool:
        """Whether S3 has ``key``, asked of S3 itself (a HEAD through the worker) rather
        than of :attr:`s3_index`, which lags another node's DELETE until the next LIST."""
        if not self.up or not self.has_s3:
            return False
        try:
            status, _ = await self._call(SsdOp.CONFIRM, key)
        except SsdUnavailableError:
            return False
        return status == SsdStatus.OK

    def evict(self, key: bytes) -> None:
        """Drop ``key`` from the SSD only, now from the index and soon from disk; S3 keeps
        its copy (unlike :meth:`delete`)."""
        self._forget(key)
        if self.up:
            self._call(SsdOp.EVICT, key).add_done_callback(self._count_failure)
        self.events.dropped(key, "room")

    def _forget(self, key: bytes) -> None:
        """``key`` is no longer on the SSD (S3 is another matter)."""
        self.index.pop(key, None)
        self._quotas.forget(key)

    def _written(self, future: asyncio.Future[tuple[int, bytes]], key: bytes, length: int,
                 on_done: Callable[[bool], object], *, durable: bool = False,
                 tenant: str | None = None) -> None:
        c = self.counters
        c.pending_writes -= 1
        c.pending_write_bytes -= length
        self._quotas.arrived(tenant, length)
        overtaken = self._writing.done(key)
        stored = False
        if future.cancelled() or future.exception() is not None:
            c.errors += 1
        else:
            status, evicted = future.result()
            if status == SsdStatus.FULL:
                self.disk.mark(evicted.decode(errors="replace"))
                evicted = b""  # the payload is the reason, not evicted keys
            for i in range(0, len(evicted), 16):
                gone = evicted[i : i + 16]
                self._forget(gone)
                c.evicted += 1
                self.events.dropped(gone, "room")
            if status == SsdStatus.OK:
                if not overtaken:  # else: written, then deleted by the DELETE queued behind it
                    self._index(key, length, tenant, durable=durable)
                c.writes += 1
                c.write_bytes += length
                stored = True
            elif status in (SsdStatus.REFUSED, SsdStatus.FULL):
                c.refused += 1
            else:
                c.errors += 1
        on_done(stored)

    def _index(self, key: bytes, length: int, tenant: str | None, *, durable: bool) -> None:
        """A write-behind of ``key`` reached the SSD (and S3, if ``durable``)."""
        self._forget(key)  # a rewrite replaces the old copy (and its owner)
        if self.has_ssd:
            self.index[key] = length
            if self._quotas.limits(tenant):
                assert tenant is not None
                self._quotas.add(key, tenant, length)
        if durable:
            self.s3_index.add(key)

    async def read_into(self, key: bytes, offset: int, length: int) -> int:
        """Read ``key`` into arena[offset:offset+length]; an SsdStatus."""
        status, _ = await self._call(SsdOp.GET, key, offset, length)
        c = self.counters
        if status == SsdStatus.OK:
            c.reads += 1
            c.read_bytes += length
        elif status in (SsdStatus.MISS, SsdStatus.CORRUPT, SsdStatus.SIZE):
            self._forget(key)
            if status == SsdStatus.CORRUPT:
                c.corrupt += 1
            else:
                c.read_misses += 1
        else:
            c.errors += 1
        return status

    async def fetch(self, key: bytes) -> int | None:
        """Have the worker fetch ``key`` from S3; the RAW value's length, or None."""
        status, payload = await self._call(SsdOp.FETCH, key)
        if status == SsdStatus.OK:
            (value_len,) = _U64.unpack(payload)
            self.s3_index.add(key)
            return int(value_len)
        self.s3_index.discard(key)
        if status == SsdStatus.CORRUPT:
            self.counters.corrupt += 1
        return None

    async def copy(self, key: bytes, offset: int, length: int) -> bool:
        """Copy a fetched value into arena[offset:offset+length]."""
        status, _ = await self._call(SsdOp.COPY, key, offset, length)
        return status == SsdStatus.OK

    def holds(self, key: bytes) -> bool:
        """Whether the SSD or S3 has ``key``, or a write-behind of it is queued."""
        return key in self.index or key in self.s3_index or key in self._writing

    def delete(self, key: bytes) -> None:
        """Drop ``key`` from the indexes now and from disk and S3 soon (nobody waits).

        Queued write-behinds of ``key`` complete first, and are not indexed.
        """
        self._forget(key)
        self._writing.overtake(key)
        if self.up and self.has_s3:  # the worker logs one DELETED record for it
            self.s3_index.deleting(key)
        else:
            self.s3_index.discard(key)
        if self.up:
            self._call(SsdOp.DELETE, key).add_done_callback(self._count_failure)

    def _count_failure(self, future: asyncio.Future[tuple[int, bytes]]) -> None:
        if future.cancelled() or future.exception() is not None:
            self.counters.errors += 1

    async def worker_stats(self) -> dict[str, Any]:
        _, payload = await self._call(SsdOp.STATS)
        stats: dict[str, Any] = json.loads(payload)
        return stats

    async def describe(self) -> dict[str, dict[str, Any]]:
        """The SSD's counters and the worker's (``ssd``), and S3's (``s3``; with S3 alone
        below DRAM, the node's side of it as ``s3.node``)."""
        return await _describe(self)

    # -- internals ------------------------------------------------------------------------

    def _call(self, op: int, key: bytes = bytes(16), offset: int = 0,
              length: int = 0) -> asyncio.Future[tuple[int, bytes]]:
        if not self.up:
            raise SsdUnavailableError("the SSD worker is not running")
        return self._worker.call(op, key, offset, length)

    def _lost(self, exc: Exception | None) -> None:
        if self.up and self._worker.forwarding:  # started (start() says why it failed)
            log.error("SSD worker connection lost (%s); serving from DRAM only", exc)
        self.up = False


async def _describe(tier: SsdTier) -> dict[str, dict[str, Any]]:
    """:meth:`SsdTier.describe` (the tier's stats as the node reports them)."""
    info: dict[str, Any] = {"name": "ssd", "up": tier.up, "full": tier.full,
                            "capacity_bytes": tier.capacity_bytes,
                            "codec": CODEC_NAMES[tier.codec],
                            "num_objects": len(tier.index),
                            "raw_bytes": sum(tier.index.values()), **asdict(tier.counters)}
    if tier.up:
        try:
            async with asyncio.timeout(2):
                worker = await tier.worker_stats()
        except (SsdUnavailableError, TimeoutError):
            info["worker"] = "no answer"
        else:
            for name in ("used_bytes", "hits", "misses", "insertions", "evictions",
                         "rejections", "corrupt", "s3"):
                if name in worker:
                    info[name] = worker[name]
    out: dict[str, dict[str, Any]] = {}
    s3 = info.pop("s3", None)
    if tier.has_ssd:
        out["ssd"] = info
    if s3 is not None:
        out["s3"] = {"name": "s3", "keys_known": len(tier.s3_index), **s3}
        if not tier.has_ssd:  # the node's side: worker up, uploads pending, shed
            node = {"up": info["up"], **asdict(tier.counters)}
            out["s3"]["node"] = node
            # what was not written below is S3's shed writes here (no SSD to shed)
            out["s3"]["shed"] = out["s3"].get("shed", 0) + node["shed"]
    return out
