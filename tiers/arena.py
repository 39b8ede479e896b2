"""One preallocated memory arena and a best-fit extent allocator over it.

The arena is a single shared ``mmap`` of an anonymous memory file (``memfd``
on Linux, an unlinked temp file elsewhere): pages are committed by the kernel
only when first written, so RSS tracks what is stored, not the capacity (plus,
with ``allocate_ahead``, a window of memory allocated in a background thread
ahead of the highest extent handed out, see :class:`AheadAllocator`); PUT
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
import logging
import mmap
import os
import sys
import tempfile
import threading

from sortedcontainers import SortedList

from kvpool.protocol.pages import Populator

__all__ = ["ALIGN", "AheadAllocator", "Arena", "memory_file", "seal_writes"]

log = logging.getLogger("kvpool.tiers")

#: Extent alignment. A page: keeps slots page-aligned for a later shared-memory
#: mapping and DMA; costs up to 4 KiB per value, small next to 256 KiB+ chunks.
ALIGN = 4096


class Arena:
    """``alloc(n) -> offset | None`` and ``free(offset, n)`` over one mmap."""

    __slots__ = ("_ahead", "_by_end", "_by_size", "_by_start", "_mmap", "allocated_bytes",
                 "capacity", "fd", "gens", "view")

    def __init__(self, capacity: int, *, allocate_ahead: int = 0) -> None:
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
        #: allocates memory ahead of the extents handed out (None: pages fault on first write)
        populator = Populator(self._mmap)
        self._ahead = AheadAllocator(self.fd, capacity, allocate_ahead, populator) \
            if allocate_ahead > 0 and (populator.on or hasattr(os, "posix_fallocate")) \
            else None

    @staticmethod
    def file_size(capacity: int) -> int:
        """Bytes of the arena's memory file: the data, then the generation table."""
        return capacity + capacity // ALIGN * 8

    @staticmethod
    def extent(nbytes: int) -> int:
        """Bytes an allocation of ``nbytes`` really takes (a page for 0 or less)."""
        return (nbytes + ALIGN - 1) // ALIGN * ALIGN if nbytes > 0 else ALIGN

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
        if self._ahead is not None and start + size > self._ahead.watermark:
            self._ahead.reach(start + size)
        return int(start)

    def reuse(self, offset: int) -> None:
        """The extent at ``offset`` passes from the value it held to a new value of the
        same extent without being free between: its generation moves on (readers of the
        old value see it, as after :meth:`free`), its bytes stay allocated."""
        self.gens[offset // ALIGN] += 1

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

    def free_extents(self) -> list[tuple[int, int]]:
        """Every free extent: ``(offset, bytes)``, in no order."""
        return list(self._by_start.items())

    def free_extent_at(self, offset: int) -> int:
        """Bytes of the free extent that starts at ``offset`` (0: none does)."""
        return self._by_start.get(offset, 0)

    def free_extent_ending_at(self, offset: int) -> int:
        """Bytes of the free extent that ends at ``offset`` (0: none does)."""
        start = self._by_end.get(offset)
        return 0 if start is None else offset - start

    def _add_free(self, start: int, size: int) -> None:
        self._by_size.add((size, start))
        self._by_start[start] = size
        self._by_end[start + size] = start

    def close(self) -> None:
        if self._ahead is not None:  # before the descriptor goes (its number may be reused)
            self._ahead.stop()
        self.gens.release()
        self.view.release()
        self._mmap.close()
        os.close(self.fd)


class AheadAllocator:
    """Allocates an arena's memory in a background thread, ``window`` bytes ahead of the
    highest extent handed out, so that PUTs write into memory the kernel already has,
    mapped into the node.

    The best-fit allocator hands out a fresh arena from its start upwards (holes left by
    frees lie below the highest extent, in memory already allocated), so "ahead" is one
    frontier. Each step maps the node's pages writable with one
    ``madvise(MADV_POPULATE_WRITE)`` (:class:`~kvpool.protocol.pages.Populator`; it lets
    go of the GIL); before Linux 5.14, ``posix_fallocate`` of the memory file allocates
    the pages (their faults into the node's mapping remain). Measured on the 2-core VM
    (``python -m bench.fill``, 512 PUTs of 1 MiB into a fresh node over TCP):
    1.38 GB/s with madvise, the rate of PUTs into memory already written (1.27-1.36),
    against 0.59 with a fault per 4 KiB page; ``posix_fallocate`` alone gave 1.28x. On a refusal
    (out of memory) it stops and the pages fault in as before.
    """

    #: bytes allocated a call (the thread checks for stop between calls)
    STEP = 16 << 20

    def __init__(self, fd: int, capacity: int, window: int, populator: Populator) -> None:
        self._fd = fd
        self._populator = populator
        self._capacity = capacity
        self._window = window
        #: an extent that ends past this asks for more (a quarter window before the end of
        #: what is asked for, so a run of small extents does not wake the thread each)
        self.watermark = 0
        self._wanted = 0
        #: bytes from the arena's start that are allocated
        self.done = 0
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvpool-arena-ahead",
                                        daemon=True)
        self._thread.start()
        self.reach(0)

    def reach(self, end: int) -> None:
        """The allocator handed out an extent ending at ``end`` (the event loop's thread)."""
        self._wanted = min(self._capacity, end + self._window)
        self.watermark = self._wanted - self._window // 4 if self._wanted < self._capacity \
            else self._capacity
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread and wait for it (a step takes milliseconds)."""
        self._stopping = True
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while not self._stopping and self.done < self._wanted:
                step = min(self.STEP, self._wanted - self.done)
                try:
                    if not self._populator.populate(self.done, step):
                        if not hasattr(os, "posix_fallocate"):
                            return
                        os.posix_fallocate(self._fd, self.done, step)
                except OSError as exc:
                    log.info("DRAM arena: allocating ahead stopped at %d bytes: %s",
                             self.done, exc)
                    return
                self.done += step
            if self._stopping:
                return


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
