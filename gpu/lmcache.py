"""LMCache remote storage plugin: LMCache keeps its remote tier in a kvpool cluster.

LMCache's configuration (YAML, or ``LMCACHE_*`` variables)::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    remote_storage_plugins: ["kvpool"]
    extra_config:
      remote_storage_plugin.kvpool.module_path: kvpool.gpu.lmcache
      remote_storage_plugin.kvpool.class_name: KvpoolConnectorAdapter
      remote_storage_plugin.kvpool.url: kvpool://10.0.0.1:7700,10.0.0.2:7700

The adapter owns ``kvpool://`` URLs and LMCache's ``plugin://kvpool`` (and
``plugin://kvpool.<instance>``), the URL LMCache's remote backend asks for: a plugin
that matched its own scheme only would never be asked on the plugin path, and every
lookup would miss. Settings, each under
``remote_storage_plugin.<name>.``: ``url`` (seeds; the ``plugin://`` path needs it),
``token``, ``scope``, ``timeout_s`` (5), ``tls_ca`` (a CA file: the nodes serve TLS).

One kvpool value per LMCache chunk: LMCache's ``RemoteMetadata`` (length, shapes,
dtypes, memory format), then the ``MemoryObj``'s bytes, sent from where they lie and
received straight into a ``MemoryObj`` of LMCache's allocator. The key is
``xxh3_128("lmcache/" + CacheEngineKey.to_string())``: the same in every process
(LMCache's key string names the model, world size, worker and chunk hash), never
one of kvpool's canonical chunk keys. A chunk that is missing, corrupt (kvpool
verifies a checksum on every read), of another geometry, or unreachable is a miss,
counted in :attr:`KvpoolRemoteConnector.counters`; no exception reaches LMCache.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass
from typing import Any

import xxhash
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector import (
    ConnectorAdapter,
    ConnectorContext,
    extract_plugin_type,
)
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvpool.client import AsyncClient, KvpoolError
from kvpool.gpu.settings import settings_from
from kvpool.protocol.errors import BufferTooSmallError, ConfigError

__all__ = ["KvpoolConnectorAdapter", "KvpoolRemoteConnector", "LMCacheConfigError",
           "LMCacheSettings"]

log = logging.getLogger("kvpool.lmcache")

_SCHEME = "kvpool://"
_PLUGIN = "plugin://"


@dataclass(frozen=True, slots=True)
class LMCacheSettings:
    """The plugin's keys (``remote_storage_plugin.<name>.<key>`` in ``extra_config``)."""

    url: str
    token: str | None = None
    scope: str = "tenant"
    timeout_s: float = 5.0
    tls_ca: str | None = None

    @classmethod
    def from_config(cls, extra: dict[str, Any], name: str, url: str) -> LMCacheSettings:
        """ConfigError naming the bad key; ``url``: the URL LMCache asked for."""
        prefix = f"remote_storage_plugin.{name}."
        ours = {k[len(prefix):]: v for k, v in extra.items() if k.startswith(prefix)
                and k[len(prefix):] not in ("module_path", "class_name")}
        if url.startswith(_SCHEME):
            ours["url"] = url
        return settings_from(
            cls, ours, owner="kvpool LMCache plugin", keys="key(s)", url_field="url",
            missing_url=f"set {prefix}url to the nodes (e.g. kvpool://127.0.0.1:7700)",
            seconds=("timeout_s",), shown=lambda key: prefix + key)

    def client(self) -> AsyncClient:
        context = ssl.create_default_context(cafile=self.tls_ca) if self.tls_ca else None
        return AsyncClient(self.url, token=self.token, scope=self.scope, ssl=context,
                           timeout=self.timeout_s, connect_timeout=min(2.0, self.timeout_s),
                           client_name="kvpool-lmcache")


class KvpoolConnectorAdapter(ConnectorAdapter):  # type: ignore[misc]
    """Makes :class:`KvpoolRemoteConnector`s for ``kvpool://`` and ``plugin://kvpool``."""

    def __init__(self) -> None:
        super().__init__(_SCHEME)

    def can_parse(self, url: str) -> bool:
        if url.startswith(_SCHEME):
            return True
        return url.startswith(_PLUGIN) and extract_plugin_type(url[len(_PLUGIN):]) == "kvpool"

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        """LMCacheConfigError (LMCache does not swallow it) for settings that would leave
        a backend that never connects, or a second backend on the same pool."""
        config = context.config
        extra = dict(config.extra_config or {}) if config is not None else {}
        name = context.plugin_name or (context.url[len(_PLUGIN):]
                                       if context.url.startswith(_PLUGIN) else "kvpool")
        if context.url.startswith(_SCHEME):  # LMCache's remote_url: its legacy backend
            ours = [plugin for plugin in (getattr(config, "remote_storage_plugins", None) or ())
                    if extra.get(f"remote_storage_plugin.{plugin}.class_name")
                    == type(self).__name__]
            if ours:
                raise LMCacheConfigError(
                    f"kvpool LMCache plugin: remote_url {context.url} and "
                    f"remote_storage_plugins {ours} both name kvpool: LMCache would run "
                    "two remote backends on it; drop remote_url (the plugin block is the "
                    "way LMCache loads kvpool)")
        try:
            settings = LMCacheSettings.from_config(extra, name, context.url)
        except ConfigError as exc:
            raise LMCacheConfigError(str(exc)) from None
        return KvpoolRemoteConnector(settings, context.loop, context.local_cpu_backend)


class LMCacheConfigError(ConfigError, IrrecoverableException):  # type: ignore[misc]
    """Settings of the plugin that cannot work. LMCache lets an
    ``IrrecoverableException`` through where it logs other errors of a remote backend
    and runs on without it: a ``remote_url`` backend then fails LMCache's start; a
    plugin's is left out, with this line at ERROR ("Failed to create remote backend for
    plugin kvpool: ..."), never made and left idle."""


@dataclass
class LMCacheCounters:
    gets: int = 0
    hits: int = 0
    puts: int = 0
    misses: int = 0  #: chunks asked for and not delivered (missing, corrupt, foreign)
    errors: int = 0  #: pool calls that failed (their chunks: misses)


def chunk_key(key: Any) -> bytes:
    """The kvpool key of an LMCache ``CacheEngineKey`` (the same in every process)."""
    return bytes(xxhash.xxh3_128_digest(b"lmcache/" + key.to_string().encode("utf-8")))


class KvpoolRemoteConnector(RemoteConnector):  # type: ignore[misc]
    """LMCache's ``RemoteConnector`` over kvpool (see the module doc). Its coroutines run
    on LMCache's loop (``loop``), where the kvpool client lives."""

    def __init__(self, settings: LMCacheSettings, loop: asyncio.AbstractEventLoop,
                 local_cpu_backend: Any) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.settings = settings
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.counters = LMCacheCounters()
        self._client: AsyncClient | None = None
        self._failing = False

    @property
    def client(self) -> AsyncClient:
        if self._client is None:
            self._client = self.settings.client()
        return self._client

    def _failed(self, what: str, exc: BaseException) -> None:
        self.counters.errors += 1
        if not self._failing:
            log.warning("kvpool LMCache plugin: %s failed (%s: %s); chunks are misses",
                        what, type(exc).__name__, exc)
        self._failing = True

    # -- contains ------------------------------------------------------------------------

    async def exists(self, key: Any) -> bool:
        try:
            found = await self.client.exists(chunk_key(key))
        except (KvpoolError, OSError) as exc:
            self._failed("exists", exc)
            return False
        self._failing = False
        return bool(found)

    def exists_sync(self, key: Any) -> bool:
        return bool(asyncio.run_coroutine_threadsafe(self.exists(key), self.loop).result())

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[Any],
                                     pin: bool = False) -> int:
        """The leading keys the pool holds: one cluster-wide lookup."""
        try:
            found = await self.client.lookup([chunk_key(k) for k in keys])
        except (KvpoolError, OSError) as exc:
            self._failed("lookup", exc)
            return 0
        self._failing = False
        return min(found, len(keys))  # never more than was asked (the client checks it too)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        return int(asyncio.run_coroutine_threadsafe(
            self.batched_async_contains("", keys), self.loop).result())

    # -- get -----------------------------------------------------------------------------

    async def get(self, key: Any) -> Any:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        """Each chunk straight into a MemoryObj of LMCache's allocator (None: a miss)."""
        self.counters.gets += len(keys)
        objs = [self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes,
                                                self.meta_fmt) for _ in keys]
        heads = [bytearray(self.remote_metadata_bytes) for _ in keys]
        wanted = [i for i, obj in enumerate(objs) if obj is not None]
        got: list[int | None] = [None] * len(keys)
        try:
            sinks: list[list[bytes | bytearray | memoryview]] = [
                [heads[i], _bytes_of(objs[i])] for i in wanted]
            try:
                answers = await self.client.get_many_into([chunk_key(keys[i]) for i in wanted],
                                                          sinks)
            except BufferTooSmallError:  # a value bigger than a chunk: find it one by one
                answers = [await self._get_one(chunk_key(keys[i]), sink)
                           for i, sink in zip(wanted, sinks, strict=True)]
            for i, n in zip(wanted, answers, strict=True):
                got[i] = n
        except (KvpoolError, OSError) as exc:
            self._failed("get", exc)
        else:
            self._failing = False
        out: list[Any] = []
        for obj, head, n in zip(objs, heads, got, strict=True):
            chunk = self._unpack(obj, head, n) if obj is not None else None
            if chunk is None:
                self.counters.misses += 1
                if obj is not None:
                    obj.ref_count_down()
            else:
                self.counters.hits += 1
            out.append(chunk)
        return out

    async def _get_one(self, key: bytes, sink: list[bytes | bytearray | memoryview]
                       ) -> int | None:
        try:
            return await self.client.get_into(key, sink)
        except BufferTooSmallError:
            return None

    def _unpack(self, obj: Any, head: bytearray, n: int | None) -> Any:
        """``obj`` holding the chunk that arrived (``n`` bytes with its header), cut to
        its length; None if nothing arrived or it is not a chunk of this geometry."""
        if n is None or n <= self.remote_metadata_bytes:
            return None
        try:
            meta = RemoteMetadata.deserialize(head)
        except Exception:  # not LMCache's header
            return None
        length = n - self.remote_metadata_bytes
        if meta.length != length or list(meta.dtypes) != list(self.meta_dtypes) \
                or meta.fmt != self.meta_fmt:
            return None
        header = meta
        try:
            obj = self.reshape_partial_chunk(obj, length)
        except ValueError:
            return None
        meta = obj.meta
        if length < self.full_chunk_size_bytes and len(getattr(meta, "shapes", None) or []) == 1:
            # LMCache's reshape updates the shape its tensor reads, not the list its
            # get_shapes() (and a later put's header) reads: one group, one shape
            meta.shapes = [meta.shape]
        # the same bytes laid out in another shape (another model's, another layer count)
        # are another chunk: a miss, as the docs say
        if _shapes(header.shapes) != _shapes(obj.get_shapes()):
            return None
        return obj

    # -- put -----------------------------------------------------------------------------

    async def put(self, key: Any, memory_obj: Any) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        """Header and bytes of each chunk, sent from where they lie."""
        values = []
        for obj in memory_objs:
            data = _bytes_of(obj)
            head = RemoteMetadata(len(data), obj.get_shapes(), obj.get_dtypes(),
                                  obj.get_memory_format()).serialize()
            values.append([head, data])
        try:
            await self.client.put_many([chunk_key(k) for k in keys], values)
        except (KvpoolError, OSError) as exc:
            self._failed("put", exc)
            return
        self._failing = False
        self.counters.puts += len(keys)

    # -- the rest ------------------------------------------------------------------------

    async def list(self) -> list[str]:
        return []  # kvpool keys are hashes: LMCache's key strings cannot be listed back

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


def _shapes(shapes: Any) -> list[tuple[int, ...]]:
    """LMCache's shapes (torch.Size or lists) as plain tuples, to compare."""
    return [tuple(int(d) for d in shape) for shape in shapes or []]


def _bytes_of(obj: Any) -> memoryview:
    view = obj.byte_array
    view = view if isinstance(view, memoryview) else memoryview(view)
    return view.cast("B") if view.format != "B" else view
