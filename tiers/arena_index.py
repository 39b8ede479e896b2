"""The node's writer of the arena index (layout: ``kvpool.protocol.shm_index``).

:class:`DramTier` publishes each value it stores and withdraws it when the
value is removed (deleted, overwritten, evicted or expired) -- before its
extent is freed, so a reader that finds the slot either sees the value or a
generation that has moved on. Only the node's event loop writes here.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

from kvpool.protocol.shm_index import (
    EPOCH_AT,
    HEADER,
    HEADER_SIZE,
    INDEX_MAGIC,
    SLOT_SIZE,
    WAYS,
    IndexSlot,
    index_sets,
    pack_slot,
    set_of,
)
from kvpool.tiers.arena import memory_file, seal_writes

__all__ = ["ArenaIndex", "IndexCounters"]

_EMPTY = bytes(SLOT_SIZE)
_FULL = (1 << WAYS) - 1


@dataclass(slots=True)
class IndexCounters:
    published: int = 0
    withdrawn: int = 0
    #: values not published because their set had no free way (read with GET_SHM instead)
    set_full: int = 0


class ArenaIndex:
    """``publish(slot)`` / ``withdraw(key)`` over a shared memory file of fixed size."""

    def __init__(self, arena_capacity: int) -> None:
        self.sets = index_sets(arena_capacity)
        self.file_size = HEADER_SIZE + self.sets * WAYS * SLOT_SIZE
        self.fd = memory_file(self.file_size, "kvpool-arena-index")
        try:
            self._mmap = mmap.mmap(self.fd, self.file_size)
        except OSError as exc:
            os.close(self.fd)
            raise MemoryError(f"cannot map a {self.file_size}-byte arena index: {exc}") from exc
        # only the node writes the index (readers check values against it): once mapped,
        # the file refuses every other writable mapping, root's and its own user's too
        seal_writes(self.fd)
        self._view = memoryview(self._mmap)
        self._view[:HEADER.size] = HEADER.pack(INDEX_MAGIC, self.sets, WAYS)
        #: key -> byte offset of its slot
        self._where: dict[bytes, int] = {}
        #: per set, a bit per way in use
        self._used = [0] * self.sets
        self.counters = IndexCounters()

    def __len__(self) -> int:
        return len(self._where)

    def publish(self, slot: IndexSlot) -> bool:
        """Write ``slot`` (replacing the key's old one); False if its set is full."""
        pos = self._where.get(slot.key)
        if pos is None:
            n = set_of(slot.key, self.sets)
            used = self._used[n]
            if used == _FULL:
                self.counters.set_full += 1
                return False
            way = (~used & (used + 1)).bit_length() - 1  # the lowest free way
            self._used[n] = used | (1 << way)
            pos = HEADER_SIZE + (n * WAYS + way) * SLOT_SIZE
            self._where[slot.key] = pos
        self._view[pos : pos + SLOT_SIZE] = pack_slot(slot)
        self.counters.published += 1
        return True

    def withdraw(self, key: bytes) -> None:
        """Empty the key's slot, if it has one."""
        pos = self._where.pop(key, None)
        if pos is None:
            return
        self._view[pos : pos + SLOT_SIZE] = _EMPTY
        n, way = divmod((pos - HEADER_SIZE) // SLOT_SIZE, WAYS)
        self._used[n] &= ~(1 << way)
        self.counters.withdrawn += 1

    def set_epoch(self, epoch: int) -> None:
        """The node's cluster-map epoch: clients on another read with GET_SHM."""
        self._view[EPOCH_AT : EPOCH_AT + 8] = epoch.to_bytes(8, "little")

    def retire(self) -> None:
        """Tell readers this index is no longer kept (the node is stopping): they ask the
        node, which is gone, instead of reading values frozen in a mapping."""
        self._view[: len(INDEX_MAGIC)] = bytes(len(INDEX_MAGIC))

    def close(self) -> None:
        self._view.release()
        self._mmap.close()
        os.close(self.fd)
