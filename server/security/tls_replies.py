"""A TLS connection's replies, copied into its transport a piece at a time.

TLS encrypts from its own buffers, and its flow control misbehaves with the 0
high-water mark plain TCP uses, so a reply cannot be handed over as views of the
arena and left there until the transport drains. It is copied instead, at most
``TLS_PIECE`` bytes at a time and only while the transport holds less than its
high-water mark (``TLS_HIGH``): a TLS client that does not read costs the node a
bounded amount, however many values its GETs name. The arena entries a reply reads
stay acquired until its last piece is copied.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence

from kvpool.tiers.dram import Entry

__all__ = ["TLS_HIGH", "TLS_LOW", "TLS_PIECE", "TlsReplies"]

#: a TLS connection's replies are copied only while its transport holds less than this
TLS_HIGH = 256 << 10
TLS_LOW = 64 << 10
#: and this many bytes at a time
TLS_PIECE = 256 << 10

Buffers = Sequence[bytes | bytearray | memoryview]


class _Outgoing:
    """A reply waiting to be copied into a TLS transport, and the entries it reads."""

    __slots__ = ("buffers", "held", "index", "offset")

    def __init__(self, buffers: Buffers, held: Sequence[Entry]) -> None:
        self.buffers = buffers
        self.held = held
        self.index = 0
        self.offset = 0


class TlsReplies:
    """The replies not yet copied into the transport, in order."""

    __slots__ = ("_queue", "_release", "close_when_sent")

    def __init__(self, release: Callable[[Entry], object]) -> None:
        self._queue: deque[_Outgoing] = deque()
        self._release = release
        #: close the transport once the last queued reply is copied (graceful close)
        self.close_when_sent = False

    def __bool__(self) -> bool:
        return bool(self._queue)

    def add(self, buffers: Buffers, held: Sequence[Entry]) -> None:
        self._queue.append(_Outgoing(buffers, held))

    def pump(self, transport: asyncio.Transport, paused: Callable[[], bool]) -> None:
        """Copy queued replies into ``transport`` until ``paused()`` (its pause_writing
        ran: it is full) or none is left; then close it if :attr:`close_when_sent`."""
        queue = self._queue
        while queue and not paused():
            out = queue[0]
            while out.index < len(out.buffers) and not paused():
                view = memoryview(out.buffers[out.index]).cast("B")
                piece = view[out.offset : out.offset + TLS_PIECE]
                out.offset += len(piece)
                if out.offset >= len(view):
                    out.index, out.offset = out.index + 1, 0
                transport.write(bytes(piece))  # may call pause_writing before it returns
            if out.index < len(out.buffers):
                return
            queue.popleft()
            for entry in out.held:
                self._release(entry)
        if not queue and self.close_when_sent:
            transport.close()

    def drop(self) -> None:
        """The connection is gone: release what the queued replies read."""
        queue, self._queue = self._queue, deque()
        for out in queue:
            for entry in out.held:
                self._release(entry)
