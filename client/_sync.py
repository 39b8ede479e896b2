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
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

from opentelemetry.trace import TracerProvider

from kvpool.client import _cluster_ops as cluster_ops
from kvpool.client import _plans as plans
from kvpool.client._async import (
    AsyncClient,
    _bytearrays,
    put_args,
    raise_put_errors,
)
from kvpool.client._connection import BufferOrSegments
from kvpool.client._loop_free import LoopFree
from kvpool.client._node import Key, NodeClient, join_keys, key_bytes
from kvpool.client._options import BUSY_POLL_US, SHM_PUT_MIN_BYTES
from kvpool.client._shm_path import TOUCH_DELAY_S
from kvpool.client.transport import Transport
from kvpool.placement.cluster_map import ClusterMap
from kvpool.protocol.envelope import ZERO_FINGERPRINT
from kvpool.protocol.errors import Status
from kvpool.protocol.frames import Op, tier_names

__all__ = ["Client"]

T = TypeVar("T")
R = TypeVar("R")


def _oks(statuses: list[int]) -> list[bool]:
    return [s == Status.OK for s in statuses]


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


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
        self._lock = threading.Lock()
        self._free = LoopFree(self._async, self._loop, self._lock, self._run, allowed=blocking)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            if self._loop.is_closed():
                coro.close()
                raise RuntimeError("this kvpool Client is closed")
            try:
                return self._loop.run_until_complete(coro)
            finally:
                self._free.loop_until = time.monotonic() + TOUCH_DELAY_S

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
    def num_left_behind(self) -> int:
        """:attr:`AsyncClient.num_left_behind`."""
        return self._async.num_left_behind

    @property
    def bytes_by_path(self) -> dict[str, int]:
        """Payload bytes GETs received through shared memory ("shm") and over TCP ("tcp")."""
        return self._async.bytes_by_path

    @property
    def put_bytes_by_path(self) -> dict[str, int]:
        """Payload bytes PUTs stored through shared memory ("shm") and over TCP ("tcp")."""
        return self._async.put_bytes_by_path

    @property
    def map(self) -> ClusterMap | None:
        """The map this client routes by (see :attr:`AsyncClient.map`)."""
        return self._async.map

    @property
    def epoch(self) -> int:
        """The cluster-map epoch this client routes by (0 = standalone node)."""
        return self._async.epoch

    def connect(self) -> None:
        self._run(self._async.connect())

    def close(self) -> None:
        self._free.close()
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
        self.put_many([key], [value], ttl=ttl, pin=pin, chunk_indexes=[chunk_index],
                      num_tokens=num_tokens, fingerprint=fingerprint,
                      parents=[parent] if parent is not None else None)

    def put_many(self, keys: Sequence[Key], values: Sequence[BufferOrSegments], *,
                 ttl: float | None = None, pin: bool = False,
                 chunk_indexes: Sequence[int] | None = None, num_tokens: int = 0,
                 fingerprint: bytes = ZERO_FINGERPRINT,
                 parents: Sequence[Key | None] | None = None) -> None:
        bkeys, bparents, ttl_ms, flags = put_args(keys, values, ttl=ttl, pin=pin,
                                                  chunk_indexes=chunk_indexes,
                                                  num_tokens=num_tokens, parents=parents)

        def plan_for(node: NodeClient) -> plans.Plan[list[int]] | None:
            items = plans.put_items(node, bkeys, values, ttl_ms=ttl_ms, flags=flags,
                                    chunk_indexes=chunk_indexes, parents=bparents)
            # through the arena where the blocking link was granted it, else over TCP
            return node.shm_path.put_plan(self._free.driver(node), items,
                                          num_tokens=num_tokens, fingerprint=fingerprint)

        done = self._free.direct(plan_for)
        if done is None:
            self._run(self._async.put_many(keys, values, ttl=ttl, pin=pin,
                                           chunk_indexes=chunk_indexes, num_tokens=num_tokens,
                                           fingerprint=fingerprint, parents=parents))
            return
        raise_put_errors(bkeys, done[0], [s == Status.OK for s in done[0]])

    def get(self, key: Key) -> bytearray | None:
        done = self._free.get((key,), None)
        if done is None:
            return self._run(self._async.get_many((key,)))[0]
        return _bytearrays(done)[0]

    def get_into(self, key: Key, buffer: BufferOrSegments) -> int | None:
        done = self._free.get((key,), (buffer,))
        if done is None:
            return self._run(self._async.get_many_into((key,), (buffer,)))[0]
        return len(done[0]) if done[0] is not None else None

    def read_in_place(self, key: Key, consume: Callable[[memoryview], None]) -> bool:
        """:meth:`AsyncClient.read_in_place`: ``consume`` runs in this thread."""
        return self._free.read_in_place(key, consume)

    def get_many(self, keys: Sequence[Key]) -> list[bytearray | None]:
        done = self._free.get(keys, None)
        return _bytearrays(done) if done is not None else self._run(self._async.get_many(keys))

    def get_many_into(self, keys: Sequence[Key], buffers: Sequence[BufferOrSegments]
                      ) -> list[int | None]:
        done = self._free.get(keys, buffers)
        if done is None:
            return self._run(self._async.get_many_into(keys, buffers))
        return [len(r) if r is not None else None for r in done]

    def _either(self, plan_for: Callable[[NodeClient], plans.Plan[T] | None],
                post: Callable[[T], R], coro: Callable[[], Coroutine[Any, Any, R]]) -> R:
        """``post`` of the blocking path's result, or else ``coro()`` run on the loop (the
        async twin of the call: the same checks, errors and spans)."""
        done = self._free.direct(plan_for)
        return post(done[0]) if done is not None else self._run(coro())

    def exists(self, key: Key) -> bool:
        return self.exists_many([key])[0]

    def exists_many(self, keys: Sequence[Key]) -> list[bool]:
        return self._exists(join_keys(keys), lambda codes: list(map(bool, codes)),
                            lambda: self._async.exists_many(keys))

    def exists_tiers(self, keys: Sequence[Key]) -> list[str | None]:
        return self._exists(join_keys(keys), tier_names, lambda: self._async.exists_tiers(keys))

    def exists_codes(self, keys: bytes | Sequence[Key]) -> bytes:
        blob = keys if isinstance(keys, bytes) else join_keys(keys)
        return self._exists(blob, lambda codes: codes, lambda: self._async.exists_codes(blob))

    def _exists(self, blob: bytes, post: Callable[[bytes], R],
                coro: Callable[[], Coroutine[Any, Any, R]]) -> R:
        """``post`` of the keys' EXISTS codes: from a cluster or a standalone node with no
        event loop where it can, else ``coro()`` on the loop."""
        codes = self._free.cluster_codes(blob)
        if codes is not None:
            return post(codes)
        return self._either(lambda node: plans.exists(node, blob), post, coro)

    def delete(self, key: Key) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: Sequence[Key]) -> list[bool]:
        blob = join_keys(keys)
        return self._either(lambda node: plans.statuses(node, Op.DELETE, blob), _oks,
                            lambda: self._async.delete_many(keys))

    def lookup(self, keys: Sequence[Key]) -> int:
        return len(self.lookup_tiers(keys))

    def lookup_tiers(self, keys: Sequence[Key]) -> list[str]:
        blob = join_keys(keys)
        codes = self._free.cluster_codes(blob)
        if codes is not None:
            return cast(list[str], tier_names(cluster_ops.held_prefix(codes)))
        return self._either(lambda node: plans.lookup(node, blob),
                            lambda codes: cast(list[str], tier_names(codes)),
                            lambda: self._async.lookup_tiers(keys))

    def pin(self, key: Key) -> bool:
        blob = key_bytes(key)
        return self._either(lambda node: plans.statuses(node, Op.PIN, blob),
                            lambda statuses: _oks(statuses)[0], lambda: self._async.pin(key))

    def unpin(self, key: Key) -> bool:
        blob = key_bytes(key)
        return self._either(lambda node: plans.statuses(node, Op.UNPIN, blob),
                            lambda statuses: _oks(statuses)[0], lambda: self._async.unpin(key))

    def stats(self) -> dict[str, Any]:
        return self._run(self._async.stats())

    def cluster_map(self) -> dict[str, Any]:
        return self._run(self._async.cluster_map())
