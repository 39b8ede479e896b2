"""What a cold tier holds, in memory: each key's stored bytes and depth, the bytes in
use, and the order to evict in (:class:`~kvpool.tiers.eviction.PrefixAwareLRU`: least
recently used first, deepest first at equal recency).

The RocksDB and S3 tiers keep one each (the DRAM tier's index also holds pins, TTLs
and tenants, and keeps its own). Not thread-safe: a tier used from several threads
holds its own lock around it.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvpool.tiers.eviction import PrefixAwareLRU

__all__ = ["Ledger"]


class Ledger:
    """Keys with their sizes and depths; ``used`` bytes in all."""

    __slots__ = ("_depths", "_lru", "_sizes", "used")

    def __init__(self) -> None:
        self._sizes: dict[bytes, int] = {}
        self._depths: dict[bytes, int] = {}
        self._lru = PrefixAwareLRU()
        self.used = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self) -> Iterator[bytes]:
        """The keys held (do not add or forget while iterating)."""
        return iter(self._sizes)

    def keys(self) -> list[bytes]:
        return list(self._sizes)

    def add(self, key: bytes, size: int, depth: int) -> None:
        """Hold ``key`` (``size`` bytes, at ``depth`` in its prefix), used now."""
        self.forget(key)
        self._sizes[key] = size
        self._depths[key] = depth
        self.used += size
        self._lru.touch([(key, depth)])

    def touch(self, key: bytes) -> None:
        """``key`` (held) was used now."""
        self._lru.touch([(key, self._depths[key])])

    def forget(self, key: bytes) -> bool:
        """Drop ``key``; whether it was held."""
        size = self._sizes.pop(key, None)
        if size is None:
            return False
        self.used -= size
        del self._depths[key]
        self._lru.discard(key)
        return True

    def victims(self, capacity: int, incoming: int = 0) -> list[bytes]:
        """Drop keys, first to evict first, until ``incoming`` more bytes fit in
        ``capacity``; the keys dropped."""
        victims: list[bytes] = []
        used = self.used
        for key in self._lru.candidates():
            if used + incoming <= capacity:
                break
            victims.append(key)
            used -= self._sizes[key]
        for key in victims:
            self.forget(key)
        return victims
