"""The blocking SDK: a thin facade that runs :class:`AsyncClient` on a private loop.

Each call runs the async core to completion on an event loop owned by this
client, in the calling thread: no helper thread, no second implementation.
Calls from several threads are serialised by a lock. Do not call it from
inside a running event loop; use :class:`AsyncClient` there.

One exception: a GET that a same-host node's arena index can answer whole is
copied with no loop at all (:meth:`AsyncClient.read_local`; a loop run costs
~45 us here, as much as copying 1 MiB). The loop still runs before such a read
when the reads before it are due to be reported, or when it has not run for
``TOUCH_DELAY_S`` (50 ms): so the client hears of a node that died (its
connection's end) before reading values frozen in its index.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

from kvpool.client._async import AsyncClient
from kvpool.client._connection import BufferOrSegments
from kvpool.client._node import TOUCH_DELAY_S, Key
from kvpool.protocol.envelope import ZERO_FINGERPRINT

__all__ = ["Client"]

T = TypeVar("T")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class Client:
    """Blocking client of one kvpool node or a cluster; see :class:`AsyncClient`."""

    def __init__(self, url: str | Sequence[str] | None = None, **kwargs: Any) -> None:
        self._async = AsyncClient(url, **kwargs)
        self._loop = _new_loop()
        self._lock = threading.Lock()
        #: until when (monotonic) reads through the index may skip the loop
        self._loop_until = 0.0

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            if self._loop.is_closed():
                coro.close()
                raise RuntimeError("this kvpool Client is closed")
            try:
                return self._loop.run_until_complete(coro)
            finally:
                self._loop_until = time.monotonic() + TOUCH_DELAY_S

    @property
    def async_client(self) -> AsyncClient:
        """The async core this facade drives (for SDK extensions such as ``kvpool.gpu``)."""
        return self._async

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of :attr:`async_client` to completion on this client's loop."""
        return self._run(coro)

    @property
    def server_info(self) -> dict[str, Any]:
        return self._async.server_info

    @property
    def num_corrupt(self) -> int:
        return self._async.num_corrupt

    @property
    def bytes_by_path(self) -> dict[str, int]:
        """Payload bytes GETs received through shared memory ("shm") and over TCP ("tcp")."""
        return self._async.bytes_by_path

    @property
    def put_bytes_by_path(self) -> dict[str, int]:
        """Payload bytes PUTs stored through shared memory ("shm") and over TCP ("tcp")."""
        return self._async.put_bytes_by_path

    @property
    def epoch(self) -> int:
        """The cluster-map epoch this client routes by (0 = standalone node)."""
        return self._async.epoch

    def connect(self) -> None:
        self._run(self._async.connect())

    def close(self) -> None:
        if not self._loop.is_closed():
            self._run(self._async.close())
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    def __enter__(self) -> Client:
        self.connect()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def put(self, key: Key, value: BufferOrSegments, *, ttl: float | None = None, pin: bool = False,
            chunk_index: int = 0, num_tokens: int = 0,
            fingerprint: bytes = ZERO_FINGERPRINT, parent: Key | None = None) -> None:
        self._run(self._async.put(key, value, ttl=ttl, pin=pin, chunk_index=chunk_index,
                                  num_tokens=num_tokens, fingerprint=fingerprint,
                                  parent=parent))

    def put_many(self, keys: Sequence[Key], values: Sequence[BufferOrSegments], *,
                 ttl: float | None = None, pin: bool = False,
                 chunk_indexes: Sequence[int] | None = None, num_tokens: int = 0,
                 fingerprint: bytes = ZERO_FINGERPRINT,
                 parents: Sequence[Key | None] | None = None) -> None:
        self._run(self._async.put_many(keys, values, ttl=ttl, pin=pin,
                                       chunk_indexes=chunk_indexes, num_tokens=num_tokens,
                                       fingerprint=fingerprint, parents=parents))

    def get(self, key: Key) -> bytearray | None:
        return self.get_many([key])[0]

    def get_into(self, key: Key, buffer: BufferOrSegments) -> int | None:
        return self.get_many_into([key], [buffer])[0]

    def get_many(self, keys: Sequence[Key]) -> list[bytearray | None]:
        local = self._local(keys, None)
        if local is not None:
            return cast(list[bytearray | None], local)
        return self._run(self._async.get_many(keys))

    def get_many_into(self, keys: Sequence[Key], buffers: Sequence[BufferOrSegments]
                      ) -> list[int | None]:
        local = self._local(keys, buffers)
        if local is not None:
            return cast(list[int | None], local)
        return self._run(self._async.get_many_into(keys, buffers))

    def _local(self, keys: Sequence[Key], buffers: Sequence[BufferOrSegments] | None
               ) -> list[bytearray | None] | list[int | None] | None:
        """The GET through the arena index with no loop (None: not possible, use the loop)."""
        with self._lock:
            if self._loop.is_closed():
                raise RuntimeError("this kvpool Client is closed")
            client = self._async
            if client.touch_due or time.monotonic() >= self._loop_until:
                if not client.can_read_local:
                    return None
                # report what is due; hear of connections that ended meanwhile
                self._loop.run_until_complete(client.send_touches())
                self._loop_until = time.monotonic() + TOUCH_DELAY_S
            return client.read_local(keys, buffers)  # None where it cannot

    def exists(self, key: Key) -> bool:
        return self._run(self._async.exists(key))

    def exists_many(self, keys: Sequence[Key]) -> list[bool]:
        return self._run(self._async.exists_many(keys))

    def exists_tiers(self, keys: Sequence[Key]) -> list[str | None]:
        return self._run(self._async.exists_tiers(keys))

    def exists_codes(self, keys: bytes | Sequence[Key]) -> bytes:
        return self._run(self._async.exists_codes(keys))

    def delete(self, key: Key) -> bool:
        return self._run(self._async.delete(key))

    def delete_many(self, keys: Sequence[Key]) -> list[bool]:
        return self._run(self._async.delete_many(keys))

    def lookup(self, keys: Sequence[Key]) -> int:
        return self._run(self._async.lookup(keys))

    def lookup_tiers(self, keys: Sequence[Key]) -> list[str]:
        return self._run(self._async.lookup_tiers(keys))

    def pin(self, key: Key) -> bool:
        return self._run(self._async.pin(key))

    def unpin(self, key: Key) -> bool:
        return self._run(self._async.unpin(key))

    def stats(self) -> dict[str, Any]:
        return self._run(self._async.stats())

    def cluster_map(self) -> dict[str, Any]:
        return self._run(self._async.cluster_map())
