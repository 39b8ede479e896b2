"""When the kernel wakes a reader for a connection: ``SO_RCVLOWAT`` while a value comes.

A 1 MiB value crosses loopback in segments of up to 64 KiB, and each one queued on the
reader's socket wakes its event loop: ~16 wake-ups a value, each paid on both ends (the
sender's ``sendmsg`` runs the reader's wake-up in its own system call). With the
socket's low-water mark set to the bytes of the value still to come (up to a most), the
kernel wakes the reader once they are all there, and it takes them in one receive,
straight into the value's buffer. The node does it for a PUT value (into its arena
slot), the async client for a GET payload (into the caller's buffer); the sync client
receives with ``MSG_WAITALL`` instead (client/_socket.py). The mark is never above what
the peer is sure to send (the rest of a value whose length its frame declared), and
Linux wakes the reader anyway when its receive buffer fills (it also grows that buffer
to twice the mark) or the peer closes, so no mark can stall a connection. Measured in
docs/notebook/2026-12-07-wakeups.md.

The option is set through ``ctypes``: uvloop's transports hand out a stand-in socket
that builds a Python socket object for every ``setsockopt`` (~15 us), and a duplicate
descriptor a connection would double a node's descriptors. Linux only; elsewhere, and
on TLS connections (the TLS layer reads records, not values), nothing is set. (Like
``pages.py``, one system call on a descriptor in ``protocol/``: no socket object, no
asyncio.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import socket
import sys

__all__ = ["WAKE_MAX", "WAKE_MIN", "WakeMark"]

#: a value with at least this much still to come wakes the reader once all of it is in
WAKE_MIN = 64 << 10
#: ... or once this much of it is (the node's default): the node copies a large value's
#: first part while the client still sends the rest (a 4 MiB PUT one a call: 0.93x Redis
#: at 512 KiB, 0.80x with the whole value's mark)
WAKE_MAX = 512 << 10


def _setsockopt() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fn = libc.setsockopt
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32)
    fn.restype = ctypes.c_int
    return fn


_SETSOCKOPT = _setsockopt()
_INT_SIZE = ctypes.sizeof(ctypes.c_int)


class WakeMark:
    """One connection's receive low-water mark (1, the kernel's default, between values).

    ``sock``: the connection's plain TCP socket (None: no marks); ``most``: the highest
    mark set (default :data:`WAKE_MAX`)."""

    __slots__ = ("_fd", "_most", "_value", "mark")

    def __init__(self, sock: socket.socket | None, most: int = WAKE_MAX) -> None:
        #: the socket's descriptor (-1: marks are not set on this connection)
        self._fd = sock.fileno() if sock is not None and _SETSOCKOPT is not None else -1
        self._most = max(most, WAKE_MIN)
        self._value = ctypes.c_int(1)
        #: the mark in force
        self.mark = 1

    def expect(self, left: int) -> None:
        """``left`` bytes of a value are sure to come next (0: none are): wake once they
        are in, up to ``most``, or at the next byte where fewer than :data:`WAKE_MIN`
        are."""
        want = min(left, self._most) if left >= WAKE_MIN else 1
        if want == self.mark or self._fd < 0:
            return
        self._value.value = want
        assert _SETSOCKOPT is not None
        if _SETSOCKOPT(self._fd, socket.SOL_SOCKET, socket.SO_RCVLOWAT,
                       ctypes.byref(self._value), _INT_SIZE) != 0:
            self._fd = -1  # (a closed socket, or a kernel without it: stop trying)
            return
        self.mark = want

    def close(self) -> None:
        """The connection is gone (its descriptor number may soon be another's)."""
        self._fd = -1
