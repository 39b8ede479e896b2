"""Mapping a shared memory range's pages writable before it is written.

A write into a page of a shared mapping that this process has not touched yet takes a
page fault (and, for memory the kernel has not allocated yet, the page's allocation and
zeroing) on the writer's path. ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14) does all of
that for a range in one call, off that path: the node does it for its arena ahead of
what it stores, a same-host client for an arena slot before it copies into it. Both ends
use this one helper. (Like ``host.py``, a read of the machine in ``protocol/``: one
syscall on memory, no sockets, no asyncio.)
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from collections.abc import Callable

__all__ = ["MADV_POPULATE_WRITE", "Populator"]

#: madvise(2) advice that maps a range's pages writable in one call, as if each page had
#: been written (Linux 5.14; Python's mmap module does not name it)
MADV_POPULATE_WRITE = 23


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise through ctypes, which lets go of the GIL while it runs; None where
    there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


class Populator:
    """Populates ranges of one writable mmap; after the kernel's first refusal (before
    5.14: EINVAL) it does nothing, and writes take their faults as before."""

    __slots__ = ("_address",)

    def __init__(self, mm: mmap.mmap) -> None:
        #: where the mapping starts; 0: off
        self._address = 0
        if _madvise() is not None:
            probe = ctypes.c_char.from_buffer(mm)
            self._address = ctypes.addressof(probe)
            del probe  # else the mapping could not be closed

    @property
    def on(self) -> bool:
        return self._address != 0

    def populate(self, offset: int, length: int) -> bool:
        """Map ``[offset, offset + length)`` writable; False if it was not (off, or the
        kernel refused: then off from now on). The mapping must still be open."""
        madvise = _madvise()
        if not self._address or madvise is None:
            return False
        if madvise(self._address + offset, length, MADV_POPULATE_WRITE) != 0:
            self._address = 0
            return False
        return True
