"""What a tier holds, in memory: a record for each key (its stored bytes and its depth in
its prefix), the bytes in use, and the order to evict in (a policy of
``tiers/eviction.py``: ``lru`` unless the tier names another).

Every tier keeps one. The RocksDB and S3 tiers hold :class:`Held` records and evict by
bytes (:meth:`Ledger.victims`). The DRAM tier's records are its entries (offset, pins,
readers, TTL, tenant) and its ledger is its index: a pinned entry is held out of the
eviction order, and since its room is a free extent of its arena rather than a byte
count, it walks :meth:`Ledger.candidates` itself (``tiers/dram.py``, ``tiers/room.py``).

Not thread-safe: a tier used from several threads holds its own lock around it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvpool.tiers.eviction import eviction_order

__all__ = ["Held", "Ledger", "Record"]


class Record(Protocol):
    """What the ledger reads of a record: its stored bytes and its depth in its prefix."""

    @property
    def length(self) -> int: ...

    @property
    def depth(self) -> int: ...


@dataclass(slots=True, frozen=True)
class Held:
    """A cold tier's record: ``length`` stored bytes at ``depth`` in its prefix."""

    length: int
    depth: int


R = TypeVar("R", bound=Record)


class Ledger(Generic[R]):
    """Records by key; ``used`` bytes in all; the eviction order of the keys not held out."""

    __slots__ = ("_order", "records", "used")

    def __init__(self, policy: str = "lru") -> None:
        #: the records by key (read it freely; change it only through the ledger)
        self.records: dict[bytes, R] = {}
        records = self.records
        self._order = eviction_order(
            policy, lambda key: getattr(records.get(key), "parent", None))
        self.used = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.records

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[bytes]:
        """The keys held (do not add or forget while iterating)."""
        return iter(self.records)

    def keys(self) -> list[bytes]:
        return list(self.records)

    @property
    def evictable(self) -> int:
        """How many keys are in the eviction order (the rest are held out)."""
        return len(self._order)

    def add(self, key: bytes, record: R, *, used_now: bool = True) -> None:
        """Hold ``key``'s ``record`` (in place of any before it), used now; with
        ``used_now=False`` it joins the eviction order only when touched (a batch stored
        together is touched at once, in depth order)."""
        records = self.records
        if key in records:
            self.forget(key)
        records[key] = record
        self.used += record.length
        if used_now:
            self._order.touch([(key, record.depth)])

    def touch(self, key: bytes) -> None:
        """``key`` (held) was used now."""
        self._order.touch([(key, self.records[key].depth)])

    def touch_many(self, batch: Iterable[tuple[bytes, int]]) -> Sequence[bytes]:
        """``(key, depth)`` pairs (held) were used now, together: the deepest become the
        first to evict among them. The keys new to the order that the policy remembers
        evicting before (stored again; ``lru`` remembers none)."""
        return self._order.touch(batch)

    def notice(self, keys: Iterable[bytes]) -> None:
        """Held ``keys`` were looked up without being read (a use to some policies)."""
        self._order.notice(keys)

    def hold_out(self, key: bytes) -> None:
        """Never offer ``key`` (held) as a victim until it is touched again (a pin)."""
        self._order.discard(key)

    def forget(self, key: bytes, *, evicted: bool = False) -> R | None:
        """Drop ``key`` (``evicted``: to make room, rather than deleted or replaced); its
        record, if it was held."""
        record = self.records.get(key)
        if record is None:
            return None
        self._order.discard(key, evicted=evicted)
        del self.records[key]
        self.used -= record.length
        return record

    def first(self) -> bytes | None:
        """The first key of :meth:`candidates` (None: none held in the order)."""
        return self._order.first()

    def candidates(self) -> Iterator[bytes]:
        """The keys not held out, first to evict first (their records are in
        :attr:`records`). Do not add or forget while iterating."""
        return self._order.candidates()

    def victims(self, capacity: int, incoming: int = 0) -> list[bytes]:
        """Drop keys, first to evict first, until ``incoming`` more bytes fit in
        ``capacity``; the keys dropped."""
        victims: list[bytes] = []
        used = self.used
        records = self.records
        for key in self._order.candidates():
            if used + incoming <= capacity:
                break
            victims.append(key)
            used -= records[key].length
        for key in victims:
            self.forget(key, evicted=True)
        return victims
