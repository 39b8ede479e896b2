"""Reads through a node's arena index, reported to the node later in batched TOUCH frames:
the node counts them (hits, tokens served, bytes by path ``shm``) and refreshes their
recency, as if it had served them. Nothing holds a value read that way, so the report is
all the node hears of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvpool.client import _plans as plans
from kvpool.client._connection import Connection
from kvpool.client._shm_put import ArenaHost, ignore_result
from kvpool.protocol.errors import KvpoolError
from kvpool.protocol.frames import Op
from kvpool.protocol.parsers import Reply

__all__ = ["TOUCH_BATCH", "TOUCH_DELAY_S", "Touches"]

#: reads through the arena index are reported to the node (TOUCH: its hit counts, byte
#: counts and LRU recency) once this many are waiting, or this long after the first
TOUCH_BATCH = 256
TOUCH_DELAY_S = 0.05


class Touches:
    """The reads through one node's index not yet reported, and the TOUCH frames that
    report them. ``conn`` finds an open connection granted the arena (None: none)."""

    def __init__(self, node: ArenaHost, conn: Callable[[], Connection | None]) -> None:
        self.node = node
        self._conn = conn
        self._keys: list[bytes] = []
        self._count = 0
        self._since = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def note(self, keys: bytes, count: int) -> None:
        """``count`` keys (``keys``, joined) were read through the index."""
        if not self._keys:
            self._since = time.monotonic()
        self._keys.append(keys)
        self._count += count

    def close(self) -> None:
        """Stop the timer (reads still to report are sent first, when a loop runs)."""
        if self._keys:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no running loop: they are dropped
                pass
            else:
                self.send(None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def due(self) -> bool:
        """Reads wait to be reported: enough of them, or for long enough."""
        return bool(self._keys) and (self._count >= TOUCH_BATCH
                                     or time.monotonic() - self._since >= TOUCH_DELAY_S)

    def later(self, conn: Connection | None = None) -> None:
        """Send the reads as one TOUCH now if due, else soon (a timer). Needs the
        running loop."""
        if not self._keys:
            return
        if self.due:
            self.send(conn)
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(TOUCH_DELAY_S, self.send, None)

    async def flush(self) -> None:
        """Report the reads now, and wait until the node has counted them (so the stats
        asked next include them)."""
        if self._keys:
            sent = self.send(None)
            if sent:
                await asyncio.wait(sent)

    def send(self, conn: Connection | None) -> list[asyncio.Future[Reply]]:
        """The TOUCH frames sent (none: nothing to report, or no connection for it)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if conn is None or not conn.is_open:
            conn = self._conn()
        keys, count = b"".join(self._keys), self._count
        self._keys.clear()
        self._count = 0
        sent: list[asyncio.Future[Reply]] = []
        if conn is None:  # the connection is gone: so is what it would count
            return sent
        for part in plans.chunks(count, int(self.node.server_info["max_batch"])):
            try:
                touch = conn.send(Op.TOUCH, len(part), [plans.blob_part(keys, part)],
                                  epoch=self.node.epoch)
            except KvpoolError:
                break
            touch.add_done_callback(ignore_result)
            sent.append(touch)
        return sent
