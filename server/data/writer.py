"""One connection's replies on their way out, and the arena entries they reference.

The write buffer's high-water mark is 0 on plain TCP, so ``pause_writing`` /
``resume_writing`` tell exactly when every queued reply has left the process: until
then the entries a reply references stay held (never evicted or reused). TLS encrypts
from its own buffers, so there replies are copied out piece by piece as the transport
drains (``server/security/tls_replies.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from kvpool.server.security.tls_replies import TLS_HIGH, TLS_LOW, TlsReplies
from kvpool.tiers.dram import Entry

__all__ = ["ReplyWriter"]

Buffers = Sequence[bytes | bytearray | memoryview]


class ReplyWriter:
    """Replies queued on one transport; ``release`` gives back an entry once nothing
    reads its views any more."""

    __slots__ = ("_held", "_outgoing", "_release", "_tls", "_transport", "paused")

    def __init__(self, release: Callable[[Entry], None]) -> None:
        self._release = release
        self._transport: asyncio.Transport | None = None
        self._tls = False
        #: entries of replies queued while writing was paused
        self._held: list[Entry] = []
        #: TLS only: replies not yet copied into the transport, in order
        self._outgoing = TlsReplies(release)
        #: the transport's buffer is full (between pause_writing and resume_writing)
        self.paused = False

    def attach(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        # TLS encrypts replies later, from its own backlog of our buffers, and its flow
        # control misbehaves with a 0 high-water mark: replies are copied out of the arena
        # piece by piece as the transport drains (see the module doc)
        self._tls = transport.get_extra_info("sslcontext") is not None
        if self._tls:
            transport.set_write_buffer_limits(high=TLS_HIGH, low=TLS_LOW)
        else:
            transport.set_write_buffer_limits(high=0, low=0)

    @property
    def copying(self) -> bool:
        """TLS replies are still to copy into the transport."""
        return bool(self._outgoing)

    def write(self, buffers: Buffers, held: Sequence[Entry] = ()) -> None:
        """Queue a reply; ``held`` entries are released once nothing reads their views."""
        assert self._transport is not None
        if self._tls:
            self._outgoing.add(buffers, held)
            self._pump()
            return
        self._transport.writelines(buffers)
        if held:
            if self.paused:
                self._held.extend(held)
            else:
                for entry in held:
                    self._release(entry)

    def resumed(self) -> bool:
        """The transport drained: release what it held, copy more TLS replies; False if
        that filled it again (still paused)."""
        self.paused = False
        self.drop_held()
        if self._outgoing:
            self._pump()
        return not self.paused

    def close_when_sent(self) -> None:
        """TLS: close the transport once every queued reply is copied into it."""
        self._outgoing.close_when_sent = True

    def drop_held(self) -> None:
        held, self._held = self._held, []
        for entry in held:
            self._release(entry)

    def drop(self) -> None:
        """The connection is gone: release everything queued."""
        self.drop_held()
        self._outgoing.drop()

    def _pump(self) -> None:
        if self._transport is not None:
            self._outgoing.pump(self._transport, lambda: self.paused)
