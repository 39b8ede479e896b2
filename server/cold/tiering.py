"""A node's tiers as one store: DRAM over the cold tier (SSD, and S3 below it).

:class:`TierManager` decides where a chunk lives and moves it between tiers; the
op table (``server/data/handlers.py``) decodes requests, calls it, and encodes its
answers. Its rules, all here:

- what lies below DRAM is the node's :class:`TieringPolicy` (``protocol/worker.py``):
  the SSD tier, S3 below it, or S3 alone;
- every chunk committed to DRAM is queued for a write-behind to the tier below
  (skipped if it has that key already: keys are content addresses), so that
  evicting it from DRAM later is a plain drop; the worker writes it on to S3
  when the policy says so;
- a chunk with a TTL lives in DRAM only (the cold tiers keep no expiry), so it can
  never outlive its TTL: a cold copy of its key is deleted instead;
- with :attr:`TieringPolicy.write_through` (and S3 configured), a PUT is acknowledged
  only once S3 holds the chunk (:meth:`TierManager.make_durable`);
- a read that misses DRAM but hits the SSD index reserves a DRAM slot, has the SSD
  worker fill it (and verify the checksum), commits it and serves it (a promotion);
  with S3, a miss everywhere else asks S3 too (another node may have written the
  chunk since this node's last LIST), and the chunk goes behind to the SSD;
- every change of where a chunk lives is published on :attr:`TierManager.events`.

Nothing here reads a wire request: the manager is tested, and used, with keys,
slots and entries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from opentelemetry.trace import Tracer

from kvpool.protocol.frames import Tier
from kvpool.protocol.worker import SsdStatus, TieringPolicy
from kvpool.server.admin.events import EventBus
from kvpool.server.admin.tracing import tier_span
from kvpool.server.cold.base import ColdTier
from kvpool.server.cold.reports import TierReports, chunk_info
from kvpool.server.cold.worker_channel import SsdUnavailableError
from kvpool.tiers.dram import DramTier, Entry, Slot

_SSD, _S3 = int(Tier.SSD), int(Tier.S3)
assert int(Tier.DRAM) == 1  # ``tiers`` writes DRAM hits as bytes of bools

__all__ = ["TierManager", "TieringPolicy"]


class Quota(Protocol):
    """A tenant's limits (``TenantQuota`` of the tokens file); 0: none."""

    @property
    def dram_bytes(self) -> int: ...

    @property
    def ssd_bytes(self) -> int: ...


class TierManager:
    """DRAM and the cold tier of one node: store, read (promoting), delete, evict, flush.

    ``cold``: what lies below DRAM (:mod:`kvpool.server.cold.base`: the SSD worker's
    handle, or ``NoColdTier()`` for a DRAM-only node), started; ``policy``: how chunks
    go below (the node's config). ``tracer``: gives the tracer for the spans of
    promotions (reads of a request, whose span may be current), or None while tracing
    is off.
    """

    def __init__(self, dram: DramTier, cold: ColdTier, events: EventBus, *,
                 policy: TieringPolicy | None = None,
                 tracer: Callable[[], Tracer | None] = lambda: None) -> None:
        self.dram = dram
        self.cold = cold
        self.events = events
        self.policy = policy or TieringPolicy()
        self.promotions = 0
        self._tracer = tracer
        #: what subscribers hear (the tiers report what they drop there by themselves)
        self.reports = TierReports(dram, cold, events)

    # -- storing ----------------------------------------------------------------------

    def commit(self, slots: Sequence[Slot], *, ttl_s: Sequence[float | None],
               pin: Sequence[bool], parents: Sequence[bytes | None]) -> list[Entry | None]:
        """Publish received slots in DRAM: their entries (None where a slot failed its
        checksum). Then either :meth:`write_behind` them, or, for the indexes
        :meth:`through` names, wait for :meth:`make_durable`."""
        committed = self.dram.commit(slots, ttl_s=ttl_s, pin=pin, parents=parents)
        self.reports.stored(committed)
        return committed

    def through(self, committed: Sequence[Entry | None]) -> list[int]:
        """Indexes of ``committed`` whose PUT waits for S3 (write-through; chunks with a
        TTL never go below DRAM); empty: write every chunk behind."""
        if not (self.policy.write_through and self.cold.has_s3):
            return []
        return [i for i, e in enumerate(committed) if e is not None and e.expires_at is None]

    def write_behind(self, entries: Iterable[Entry]) -> None:
        """Queue each chunk for the tier below (held in DRAM meanwhile); a chunk with a
        TTL deletes its key's copies below instead."""
        ssd, dram = self.cold, self.dram
        if not (ssd.has_ssd or ssd.has_s3):
            return  # nothing below (a tier that is down sheds, and counts, every write)
        reused_only = self.policy.admit == "reused"
        for entry in entries:
            if entry.expires_at is not None:
                # a chunk with a TTL lives in DRAM only, so it can never outlive its TTL
                # (nor can an older copy of its key below)
                if ssd.holds(entry.key):
                    ssd.delete(entry.key)
                continue
            # content-addressed: a copy below is the same bytes (S3 alone: one S3 holds)
            if entry.key in ssd.index or (not ssd.has_ssd and entry.key in ssd.s3_index):
                continue
            if reused_only and not (entry.reused or entry.pinned):
                ssd.counters.held_back += 1  # (written once it shows reuse: reused())
                continue
            dram.hold(entry)
            if ssd.write(entry.key, entry.offset, entry.length,
                         lambda _stored, e=entry: dram.release(e),  # type: ignore[misc]
                         tenant=entry.tenant):
                entry.queued_below = True
            else:
                dram.release(entry)

    def reused(self, entries: Iterable[Entry | None]) -> None:
        """DRAM chunks just read or looked up: with ``admit="reused"``, write behind those
        not below yet (they show reuse now)."""
        if self.policy.admit != "reused":
            return
        self.write_behind([e for e in entries if e is not None and not e.queued_below])

    async def make_durable(self, entries: Sequence[Entry]) -> list[bool]:
        """Write-through: True for each chunk S3 has once this returns."""
        ssd = self.cold
        # chunks the index says S3 has: asked of S3 itself before they are acked as
        # durable (another node may have deleted one since this node's last LIST), and
        # held meanwhile, in case they have to be written after all
        known = [i for i, e in enumerate(entries) if e.key in ssd.s3_index]
        for i in known:
            self.dram.hold(entries[i])
        try:
            there = await asyncio.gather(*(ssd.confirm(entries[i].key) for i in known))
            done = [False] * len(entries)
            for i, ok in zip(known, there, strict=True):
                done[i] = ok
            todo = [i for i, ok in enumerate(done) if not ok]
            written = await self._write_durable([entries[i] for i in todo])
            for i, ok in zip(todo, written, strict=True):
                done[i] = ok
            return done
        finally:
            for i in known:
                self.dram.release(entries[i])

    async def _write_durable(self, entries: Sequence[Entry]) -> list[bool]:
        """Write each chunk behind to the SSD and to S3; False where S3 lacks it after."""
        ssd = self.cold
        loop = asyncio.get_running_loop()
        waits: list[asyncio.Future[bool]] = []
        for entry in entries:
            done: asyncio.Future[bool] = loop.create_future()
            self.dram.hold(entry)

            def finished(stored: bool, e: Entry = entry, f: asyncio.Future[bool] = done) -> None:
                self.dram.release(e)
                if not f.done():
                    f.set_result(stored)

            if not ssd.write(entry.key, entry.offset, entry.length, finished, durable=True):
                finished(False)
            waits.append(done)
        return [await done for done in waits]

    # -- reading ----------------------------------------------------------------------

    def acquire(self, keys: Sequence[bytes]) -> list[Entry | None]:
        """Each key's DRAM entry, held for a reply (None: not in DRAM)."""
        entries = self.dram.acquire_many(keys)
        self.reused(entries)
        return entries

    def below(self, keys: Sequence[bytes], entries: Sequence[Entry | None]) -> list[int]:
        """Indexes of the DRAM misses a lower tier may hold (:meth:`promote` them)."""
        ssd = self.cold
        if not ssd.up:
            return []
        # with S3, a miss everywhere else asks S3 too: another node may have written the
        # chunk since our last LIST (EXISTS/LOOKUP never pay that round trip)
        return [i for i, e in enumerate(entries)
                if e is None and (keys[i] in ssd.index or ssd.has_s3)]

    async def promote(self, keys: Sequence[bytes], entries: list[Entry | None],
                      which: Sequence[int]) -> None:
        """Bring ``keys[i]`` for each ``i`` of ``which`` into DRAM; ``entries[i]`` then
        holds it (held, as :meth:`acquire`'s are), or stays None."""
        await asyncio.gather(*(self._promote(keys[i], entries, i) for i in which))

    async def _promote(self, key: bytes, entries: list[Entry | None], i: int) -> None:
        ssd = self.cold
        value_len = ssd.index.get(key)
        if value_len is None:
            if ssd.has_s3:
                await self._promote_from_s3(key, entries, i)
            return
        slot = self.dram.reserve(key, value_len)
        if slot is None:
            return
        with tier_span(self._tracer(), "kvpool.ssd read", bytes=value_len) as span:
            try:
                status = await ssd.read_into(key, slot.offset, value_len)
            except SsdUnavailableError:
                status = SsdStatus.ERROR
            if span is not None:
                span.set_attribute("kvpool.hit", status == SsdStatus.OK)
        if status != SsdStatus.OK:
            slot.release()
            return
        self._publish(slot, entries, i)

    async def _promote_from_s3(self, key: bytes, entries: list[Entry | None], i: int) -> None:
        """Fetch ``key`` from S3 (the worker verifies it), into DRAM, then behind to SSD."""
        ssd = self.cold
        with tier_span(self._tracer(), "kvpool.s3 read") as span:
            try:
                value_len = await ssd.fetch(key)
                if value_len is None:
                    return
                if span is not None:
                    span.set_attribute("kvpool.bytes", value_len)
                slot = self.dram.reserve(key, value_len)
                if slot is None:
                    return
                if not await ssd.copy(key, slot.offset, value_len):
                    slot.release()
                    return
            except SsdUnavailableError:
                return
        entry = self._publish(slot, entries, i)
        if entry is not None:
            self.write_behind([entry])

    def _publish(self, slot: Slot, entries: list[Entry | None], i: int) -> Entry | None:
        """Commit a promoted slot to DRAM and hold it for the reply being built."""
        (entry,) = self.dram.commit([slot])
        if entry is not None:
            entry.reused = True  # (promoted for a GET: a read)
            self.dram.hold(entry)
            entries[i] = entry
            self.promotions += 1
            self.reports.stored([entry])
        return entry

    def tiers(self, keys: Sequence[bytes]) -> bytes:
        """The fastest tier holding each key (a Tier code a byte), 0 where none does.
        No I/O."""
        in_dram = self.dram.contains_many(keys, interest=True)
        if self.policy.admit == "reused":
            peek = self.dram.peek
            self.reused(peek(key) for key, held in zip(keys, in_dram, strict=True) if held)
        codes = bytes(in_dram)  # Tier.DRAM is 1: True where DRAM holds the key
        ssd = self.cold
        if not ssd.up or all(in_dram):
            return codes
        found = bytearray(codes)
        index, s3_index = ssd.index, ssd.s3_index
        for i, held in enumerate(in_dram):  # (enum members as module globals: ~0.2 us each)
            if not held:
                key = keys[i]
                found[i] = _SSD if key in index else _S3 if key in s3_index else 0
        return bytes(found)

    # -- removing ---------------------------------------------------------------------

    def delete(self, keys: Sequence[bytes]) -> list[bool]:
        """Delete from every tier of this node; True where some tier held the key."""
        deleted = self.dram.delete_many(keys)
        # the highest tier that held each key, for the removed events
        tiers = ["dram" if gone else "" for gone in deleted]
        ssd = self.cold
        if ssd.up:
            for i, key in enumerate(keys):
                if ssd.holds(key):
                    if not deleted[i]:
                        tiers[i] = "ssd" if key in ssd.index or key not in ssd.s3_index \
                            else "s3"
                    deleted[i] = True
                    ssd.delete(key)
        self.reports.removed(keys, tiers)
        return deleted

    def evict(self, tier: str | None, namespace: bytes | None) -> dict[str, int]:
        """Drop unpinned chunks: all of ``tier`` (dram or ssd), or ``namespace``'s in DRAM.

        An eviction, not a delete: S3 keeps its copies (it is the cluster's, and a chunk
        evicted from the SSD is still served from there)."""
        counts = {"dram": 0, "ssd": 0}
        if tier in (None, "dram"):
            keep = None
            if namespace is not None:
                dram = self.dram

                def keep(entry: Entry) -> bool:
                    return bytes(dram.view(entry)[40:56]) != namespace  # envelope fingerprint

            gone = self.dram.evict_where(keep)
            counts["dram"] = len(gone)
            self.reports.evicted(gone)
        ssd = self.cold
        if tier == "ssd" and ssd.up:
            for key in list(ssd.index):
                ssd.evict(key)
                counts["ssd"] += 1
        return counts

    async def flush(self, timeout_s: float) -> dict[str, Any]:
        """Wait until the write-behind queue is empty (or ``timeout_s`` passes)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # polled: the queue drains through SSD-worker replies, which signal nothing else
        cold = self.cold
        while cold.up and cold.counters.pending_writes \
                and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        pending = cold.counters.pending_writes if cold.up else 0
        return {"flushed": pending == 0, "pending_writes": pending}

    # -- what happened, and what is there -----------------------------------------------

    def set_quotas(self, quotas: Mapping[str, Quota]) -> None:
        """Each tenant's DRAM and SSD bytes (a tenant with none: no limit there)."""
        self.dram.tenants.quotas = {t: q.dram_bytes for t, q in quotas.items() if q.dram_bytes}
        self.cold.tenants.quotas = {t: q.ssd_bytes for t, q in quotas.items() if q.ssd_bytes}

    def tenant_usage(self) -> dict[str, dict[str, int]]:
        """Each tenant's bytes in DRAM and on the SSD."""
        dram, ssd = self.dram.tenants.used, self.cold.tenants.used
        return {t: {"dram": dram.get(t, 0), "ssd": ssd.get(t, 0)}
                for t in sorted(set(dram) | set(ssd))}

    def chunk_info(self, key: bytes) -> dict[str, Any] | None:
        """What this node knows of one chunk, without reading it (None: no tier has it)."""
        return chunk_info(self.dram, self.cold, key)

    async def snapshot(self) -> dict[str, Any]:
        """Each tier's counters (the stats snapshot's ``tiers``) and the manager's own."""
        dram = self.dram.stats()
        tiers: dict[str, Any] = {"dram": dram.to_dict()}
        tiers.update(await self.cold.describe())
        return {"tiers": tiers, "promotions": self.promotions,
                "quota_evictions": self.dram.tenants.evictions,
                "quota_rejections": self.dram.tenants.rejections,
                "ssd_quota_evictions": self.cold.tenants.evictions}

