"""The blocking SDK: a thin facade that runs :class:`AsyncClient` on a private loop.

Each call runs the async core to completion on an event loop owned by this
client, in the calling thread: no helper thread, no second implementation.
Calls from several threads are serialised by a lock. Do not call it from
inside a running event loop; use :class:`AsyncClient` there. Calls that can skip the
loop (a standalone node's TCP calls, a cluster's key ops and first GET round, reads a
same-host node's arena index answers) go through :class:`kvpool.client._loop_free.LoopFree`
first, which runs the same op plans on blocking sockets.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, Generic, TypeVar, cast

from opentelemetry.trace import TracerProvider

from kvpool.client._async import (
    AsyncClient,
    as_bytearrays,
)
from kvpool.client._connection import BufferOrSegments
from kvpool.client._loop_free import LoopFree
from kvpool.client._node import Key, join_keys, key_bytes
from kvpool.client._options import BUSY_POLL_US, SHM_PUT_MIN_BYTES
from kvpool.client.transport import Transport
from kvpool.placement.cluster_map import ClusterMap
from kvpool.protocol.envelope import ZERO_FINGERPRINT
from kvpool.protocol.frames import Op, tier_names

__all__ = ["Client"]

T = TypeVar("T")
R = TypeVar("R")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class _Core(Generic[T]):
    """A read-only attribute of the sync client that is its async core's (same doc)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.__doc__ = getattr(AsyncClient, name).__doc__

    def __get__(self, client: Client | None, owner: type[Client]) -> T:
        if client is None:
            return cast(T, self)
        return cast(T, getattr(client._async, self._name))


class Client:
    """Blocking client of one kvpool node or a cluster; see :class:`AsyncClient`."""

    def __init__(self, url: str | Sequence[str] | None = None, *,
                 pool_size: int = 2, timeout: float = 10.0, connect_timeout: float = 5.0,
                 client_name: str = "kvpool-python",
                 tracer_provider: TracerProvider | None = None,
                 shm: bool | None = None, token: str | None = None, scope: str = "tenant",
                 ssl: ssl_module.SSLContext | None = None,
                 shm_put_min_bytes: int = SHM_PUT_MIN_BYTES, shm_index: bool = True,
                 transport: Transport | None = None, busy_poll_us: float = BUSY_POLL_US,
                 blocking: bool = True) -> None:
        """:class:`AsyncClient`'s arguments, plus ``blocking``: calls to a standalone node
        that go over TCP run in the calling thread on a socket of this client's own (the
        default; ~30 us a call less here); False runs them on the loop like every other
        call. ``busy_poll_us`` (default 100): how long such a call polls its socket for the
        reply before the thread sleeps; a reply that comes meanwhile needs no wake-up
        (~25 us less a small call on the 2-core VM; at most that much CPU more a call;
        0: sleep at once)."""
        self._async = AsyncClient(url, pool_size=pool_size, timeout=timeout,
                                  connect_timeout=connect_timeout, client_name=client_name,
                                  tracer_provider=tracer_provider, shm=shm, token=token,
                                  scope=scope, ssl=ssl, shm_put_min_bytes=shm_put_min_bytes,
                                  shm_index=shm_index, transport=transport,
                                  busy_poll_us=busy_poll_us)
        self._loop = _new_loop()
        self._free = LoopFree(self._async, self._loop, allowed=blocking)

    @property
    def async_client(self) -> AsyncClient:
        """The async core this facade drives (for SDK extensions such as ``kvpool.gpu``)."""
        return self._async

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of :attr:`async_client` to completion on this client's loop."""
        return self._free.run(coro)

    server_info = _Core[dict[str, Any]]("server_info")
    num_corrupt = _Core[int]("num_corrupt")
    num_left_behind = _Core[int]("num_left_behind")
    bytes_by_path = _Core[dict[str, int]]("bytes_by_path")
    put_bytes_by_path = _Core[dict[str, int]]("put_bytes_by_path")
    map = _Core[ClusterMap | None]("map")
    epoch = _Core[int]("epoch")

    def connect(self) -> None:
        self.run(self._async.connect())

    def close(self) -> None:
        self._free.close()
        if not self._loop.is_closed():
            self.run(self._async.close())
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    def __enter__(self) -> Client:
        self.connect()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def put(self, key: Key, value: BufferOrSegments, *, ttl: float | None = None, pin: bool = False,
            chunk_index: int = 0, num_tokens: int = 0, fingerprint: bytes = ZERO_FINGERPRINT,
            parent: Key | None = None) -> None:
        self.put_many([key], [value], ttl=ttl, pin=pin, chunk_indexes=[chunk_index],
                      num_tokens=num_tokens, fingerprint=fingerprint,
                      parents=[parent] if parent is not None else None)

    def put_many(self, keys: Sequence[Key], values: Sequence[BufferOrSegments], *,
                 ttl: float | None = None, pin: bool = False,
                 chunk_indexes: Sequence[int] | None = None, num_tokens: int = 0,
                 fingerprint: bytes = ZERO_FINGERPRINT, parents: Sequence[Key | None] | None = None
                 ) -> None:
        done = self._free.put(keys, values, ttl=ttl, pin=pin, chunk_indexes=chunk_indexes,
                              num_tokens=num_tokens, fingerprint=fingerprint, parents=parents)
        if not done:
            self.run(self._async.put_many(keys, values, ttl=ttl, pin=pin,
                                          chunk_indexes=chunk_indexes, num_tokens=num_tokens,
                                          fingerprint=fingerprint, parents=parents))

    def get(self, key: Key) -> bytearray | None:
        return self.get_many((key,))[0]

    def get_into(self, key: Key, buffer: BufferOrSegments) -> int | None:
        return self.get_many_into((key,), (buffer,))[0]

    def read_in_place(self, key: Key, consume: Callable[[memoryview], None]) -> bool:
        """:meth:`AsyncClient.read_in_place`: ``consume`` runs in this thread."""
        return self._free.read_in_place(key, consume)

    def get_many(self, keys: Sequence[Key]) -> list[bytearray | None]:
        done = self._free.get(keys, None)
        return as_bytearrays(done) if done is not None else self.run(self._async.get_many(keys))

    def get_many_into(self, keys: Sequence[Key], buffers: Sequence[BufferOrSegments]
                      ) -> list[int | None]:
        done = self._free.get(keys, buffers)
        if done is None:
            return self.run(self._async.get_many_into(keys, buffers))
        return [len(r) if r is not None else None for r in done]

    def exists(self, key: Key) -> bool:
        return self.exists_many([key])[0]

    def exists_many(self, keys: Sequence[Key]) -> list[bool]:
        codes = self._free.exists(join_keys(keys))
        if codes is None:
            return self.run(self._async.exists_many(keys))
        return list(map(bool, codes))

    def exists_tiers(self, keys: Sequence[Key]) -> list[str | None]:
        codes = self._free.exists(join_keys(keys))
        return tier_names(codes) if codes is not None else self.run(self._async.exists_tiers(keys))

    def exists_codes(self, keys: bytes | Sequence[Key]) -> bytes:
        blob = keys if isinstance(keys, bytes) else join_keys(keys)
        codes = self._free.exists(blob)
        return codes if codes is not None else self.run(self._async.exists_codes(blob))

    def delete(self, key: Key) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: Sequence[Key]) -> list[bool]:
        oks = self._free.oks(Op.DELETE, join_keys(keys))
        return oks if oks is not None else self.run(self._async.delete_many(keys))

    def lookup(self, keys: Sequence[Key]) -> int:
        return len(self.lookup_tiers(keys))

    def lookup_tiers(self, keys: Sequence[Key]) -> list[str]:
        codes = self._free.lookup(join_keys(keys))
        if codes is None:
            return self.run(self._async.lookup_tiers(keys))
        return cast(list[str], tier_names(codes))

    def pin(self, key: Key) -> bool:
        oks = self._free.oks(Op.PIN, key_bytes(key))
        return oks[0] if oks is not None else self.run(self._async.pin(key))

    def unpin(self, key: Key) -> bool:
        oks = self._free.oks(Op.UNPIN, key_bytes(key))
        return oks[0] if oks is not None else self.run(self._async.unpin(key))

    def stats(self) -> dict[str, Any]:
        return self.run(self._async.stats())

    def cluster_map(self) -> dict[str, Any]:
        return self.run(self._async.cluster_map())
