"""The node's end of the SSD worker's socket: requests out, replies matched back by id.

Framing is ``protocol/worker.py``'s (REQUEST out, REPLY + payload back). A reply
completes the future its request got; when the socket ends, every request still
waiting fails with :class:`SsdUnavailableError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

from kvpool.protocol.errors import KvpoolError
from kvpool.protocol.worker import REPLY, REQUEST

__all__ = ["SsdUnavailableError", "WorkerChannel"]


class SsdUnavailableError(KvpoolError):
    """The SSD worker is not running (failed to start, or died)."""


class WorkerChannel(asyncio.Protocol):
    """Requests to the worker and the futures of their replies."""

    def __init__(self, on_lost: Callable[[Exception | None], object]) -> None:
        self._on_lost = on_lost
        self._buf = bytearray()
        self._pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self._next_id = 0
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def call(self, op: int, key: bytes, offset: int, length: int
             ) -> asyncio.Future[tuple[int, bytes]]:
        """Send one request; its future gets ``(status, payload)``."""
        if self._transport is None:
            raise SsdUnavailableError("the SSD worker is not running")
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        future: asyncio.Future[tuple[int, bytes]] = \
            asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = future
        self._transport.write(REQUEST.pack(op, self._next_id, key, offset, length))
        return future

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while len(buf) >= REPLY.size:
            request_id, status, length = REPLY.unpack_from(buf)
            if len(buf) < REPLY.size + length:
                break
            payload = bytes(buf[REPLY.size : REPLY.size + length])
            del buf[: REPLY.size + length]
            future = self._pending.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result((status, payload))

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._on_lost(exc)
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(SsdUnavailableError("the SSD worker stopped"))
