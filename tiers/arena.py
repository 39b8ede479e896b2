"""One preallocated memory arena and a best-fit extent allocator over it.

The arena is a single shared ``mmap`` of an anonymous memory file (``memfd``
on Linux, an unlinked temp file elsewhere): pages are committed by the kernel
only when first written, so RSS tracks what is stored, not the capacity; PUT
payloads are received straight into it (no Python object per chunk); and the
SSD worker process maps the same file (``fd``) to read and write chunks in
place, with no copy through a pipe.
Extents are aligned to ``ALIGN`` bytes; free extents coalesce with their
neighbours, so a full cycle of alloc/free returns the arena to one extent.

After the ``capacity`` data bytes the file holds a *generation table*: one
u64 per ``ALIGN``-byte page, bumped for an extent's first page whenever the
extent is freed. A co-located client reading a value straight from the
arena (the shared-memory fast path) notes the generation of the value's
first page, copies, and reads it again: equal means no free -- hence no
reuse -- happened in between (a seqlock). x86-64 and arm64 keep a store's
ordering for these aligned u64s as far as a Python reader can observe.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import sys
import tempfile

from sortedcontainers import SortedList

__all__ = ["ALIGN", "Arena", "memory_file", "seal_writes"]

#: Extent alignment. A page: keeps slots page-aligned for a later shared-memory
#: mapping and DMA; costs up to 4 KiB per value, small next to 256 KiB+ chunks.
ALIGN = 4096


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """``alloc(n) -> offset | None`` and ``free(offset, n)`` over one mmap."""

    __slots__ = ("_by_end", "_by_size", "_by_start", "_mmap", "allocated_bytes", "capacity",
                 "fd", "gens", "view")

    def __init__(self, capacity: int) -> None:
        capacity = capacity // ALIGN * ALIGN
        if capacity < ALIGN:
            raise ValueError(f"arena capacity must be at least {ALIGN} bytes")
        self.capacity = capacity
        try:
            self.fd = memory_file(self.file_size(capacity))
            self._mmap = mmap.mmap(self.fd, self.file_size(capacity))
        except OSError as exc:  # e.g. vm.overcommit_memory=2 or a ulimit -v
            raise MemoryError(f"cannot map a {capacity}-byte DRAM arena: {exc}") from exc
        whole = memoryview(self._mmap)
        self.view = whole[:capacity]
        #: the generation of each page (see the module doc); the fast path's clients map it
        self.gens = whole[capacity:].cast("Q")
        whole.release()
        self._by_size: SortedList = SortedList([(capacity, 0)])
        self._by_start: dict[int, int] = {0: capacity}
        self._by_end: dict[int, int] = {capacity: 0}
        self.allocated_bytes = 0

    @staticmethod
    def file_size(capacity: int) -> int:
        """Bytes of the arena's memory file: the data, then the generation table."""
        return capacity + capacity // ALIGN * 8

    @staticmethod
    def extent(nbytes: int) -> int:
        """Bytes an allocation of ``nbytes`` really takes."""
        return _round_up(max(nbytes, 1))

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.allocated_bytes

    @property
    def largest_free(self) -> int:
        return int(self._by_size[-1][0]) if self._by_size else 0

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a fresh extent for ``nbytes``, or None if no free extent fits."""
        size = self.extent(nbytes)
        i = self._by_size.bisect_left((size, -1))
        if i == len(self._by_size):
            return None
        free_size, start = self._by_size.pop(i)
        del self._by_start[start]
        del self._by_end[start + free_size]
        if free_size > size:
            self._add_free(start + size, free_size - size)
        self.allocated_bytes += size
        return int(start)

    def free(self, offset: int, nbytes: int) -> None:
        self.gens[offset // ALIGN] += 1  # before any reuse: readers of the old value see it
        size = self.extent(nbytes)
        self.allocated_bytes -= size
        start, end = offset, offset + size
        prev_start = self._by_end.pop(start, None)
        if prev_start is not None:
            prev_size = self._by_start.pop(prev_start)
            self._by_size.remove((prev_size, prev_start))
            start = prev_start
        next_size = self._by_start.pop(end, None)
        if next_size is not None:
            del self._by_end[end + next_size]
            self._by_size.remove((next_size, end))
            end += next_size
        self._add_free(start, end - start)

    def _add_free(self, start: int, size: int) -> None:
        self._by_size.add((size, start))
        self._by_start[start] = size
        self._by_end[start + size] = start

    def close(self) -> None:
        self.gens.release()
        self.view.release()
        self._mmap.close()
        os.close(self.fd)


#: F_SEAL_FUTURE_WRITE (Linux 5.1): no new writable mapping and no write(), whoever asks
#: (root too); mappings made before it keep writing. Python's fcntl does not name it.
F_SEAL_FUTURE_WRITE = 0x0010


def memory_file(size: int, name: str = "kvpool-arena") -> int:
    """A file descriptor of ``size`` bytes of memory, mode 0600, with no name.

    On Linux its size is sealed: a process handed a descriptor cannot shrink it under
    the node's mapping (a SIGBUS) or grow it. Mode 0600 keeps a process of another user
    that was handed a read-only descriptor from reopening it (``/proc/self/fd/N``)
    for writing; memfds are made 0777. See :func:`seal_writes` for the index.
    """
    linux = sys.platform.startswith("linux")
    if linux:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.fchmod(fd, 0o600)
    else:  # pragma: no cover - macOS: an unlinked file in the temp dir (mode 0600)
        fd, path = tempfile.mkstemp(prefix=f"{name}-")
        os.unlink(path)
    os.ftruncate(fd, size)
    if linux:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def seal_writes(fd: int) -> None:
    """After the owner has mapped ``fd`` writable: nobody else ever can (Linux only)."""
    if sys.platform.startswith("linux"):
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
