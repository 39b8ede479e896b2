"""SGLang HiCache storage backend: SGLang's hierarchical cache keeps its L3 pages in kvpool.

Load it through SGLang's storage-backend factory (SGLang >= 0.5.23)::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-mem-layout page_first \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
            "module_path": "kvpool.gpu.sglang", "class_name": "KvpoolHiCacheStorage",
            "interface_v1": 1, "kvpool_url": "kvpool://127.0.0.1:7700"}'

``interface_v1: 1`` makes SGLang's cache controller use the zero-copy calls:
``batch_get_v1`` receives each page straight into its place in the pinned host
pool, ``batch_set_v1`` sends it from there (no staging copy on either side).
Other keys of the extra config (:class:`HiCacheSettings`): ``kvpool_url`` (a node
or comma-separated seeds; the only one needed), ``token``, ``scope``,
``timeout_s``, ``retry_after_s``, ``shm``.

One kvpool value per SGLang page: the page's bytes as SGLang's host pool holds
them (``get_page_buffer_meta``: K then V of the page for the ``page_first``
layouts; per layer for ``layer_first``, sent all K first, then all V, so the bytes
equal SGLang's flat data page in every layout). The key is
``xxh3_128(namespace digest || SGLang's page key)``: SGLang's page keys already
chain the whole prefix, and the namespace (:func:`page_namespace`) says these are
SGLang host-pool pages of this model, layout, page size, dtype and TP/PP rank
(``kv_format="sglang-<layout>[-mla][-<pool format>]-pp<rank>of<size>"``), so they never collide
with kvpool's canonical chunks or with another layout, and two SGLang deployments
of the same model share them.

Never raises on the data path: a node error, a timeout, a missing or corrupt page is
a miss (``False``, or a shorter prefix), counted in :attr:`KvpoolHiCacheStorage.counters`
and logged once per back-off; after a failure the backend leaves the pool alone for
``retry_after_s`` (doubling while it keeps failing), so a hung node costs SGLang one
``timeout_s`` per back-off, not one per batch. ``batch_exists`` is one round trip
(kvpool's cluster-wide ``lookup``); ``batch_set_v1`` first asks which pages the pool
already has (``exists_many``) and sends only the others.

Reads and writes use a client each (SGLang prefetches and backs up on two threads,
and a client serialises its calls).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvpool.client import Client, KvpoolError
from kvpool.gpu.backoff import Backoff
from kvpool.gpu.layout import dtype_name
from kvpool.gpu.settings import settings_from
from kvpool.placement.keys import Namespace
from kvpool.protocol.errors import BufferTooSmallError, ConfigError

__all__ = ["HiCacheSettings", "KvpoolHiCacheStorage", "page_namespace"]

#: one page's bytes, where they lie (a value of several segments)
Page = list[bytes | bytearray | memoryview]

log = logging.getLogger("kvpool.sglang")

#: keys of the extra config that SGLang itself reads (the factory's and the controller's)
_SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1",
                          "interface_v2", "tp_lcm_size", "should_split_heads"})


@dataclass(frozen=True, slots=True)
class HiCacheSettings:
    """The kvpool keys of ``--hicache-storage-backend-extra-config``."""

    #: a node URL, or a comma-separated seed list (``kvpool://`` optional)
    kvpool_url: str
    #: the tenant token (default: ``$KVPOOL_TOKEN``)
    token: str | None = None
    #: "tenant" (the token's own), "shared" (readable by every tenant) or "raw"
    scope: str = "tenant"
    #: seconds a pool call may take before it is a miss
    timeout_s: float = 5.0
    #: after a failed call the pool is left alone this long (doubling, up to 12x)
    retry_after_s: float = 5.0
    #: same-host shared memory: None = when the node offers it
    shm: bool | None = None

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> HiCacheSettings:
        """ConfigError naming the bad key (SGLang then fails at start with that line)."""
        return settings_from(
            cls, {k: v for k, v in extra.items() if k not in _SGLANG_KEYS},
            owner="kvpool HiCache backend", keys="extra config key(s)",
            missing_url='the extra config needs "kvpool_url" (e.g. "kvpool://127.0.0.1:7700")')

    def client(self) -> Client:
        return Client(self.kvpool_url, token=self.token, scope=self.scope, shm=self.shm,
                      timeout=self.timeout_s, connect_timeout=min(2.0, self.timeout_s),
                      client_name="kvpool-sglang")


@dataclass
class HiCacheCounters:
    """What the backend did since it was made (``get_stats`` reports the page counts)."""

    lookups: int = 0
    pages_looked_up: int = 0
    pages_hit: int = 0
    pages_loaded: int = 0
    pages_stored: int = 0
    pages_skipped: int = 0  #: the pool had them already
    bytes_loaded: int = 0
    bytes_stored: int = 0
    errors: int = 0  #: pool calls that failed (each a miss)
    backed_off: int = 0  #: calls not made while backing off (each a miss)
    #: since the last get_stats: pages and GB/s of each batch, as SGLang's metrics take them
    recent: dict[str, list[float]] = field(default_factory=lambda: {
        "prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
        "backup_bandwidth": []})


def page_namespace(config: HiCacheStorageConfig, host_pool: Any) -> Namespace:
    """The namespace of this rank's pages: model, dtype, geometry, page size, TP rank
    (MLA: one copy for every TP rank), and a ``kv_format`` naming the host pool's layout
    and the PP rank."""
    layout = str(getattr(host_pool, "layout", "page_first"))
    mla = bool(config.is_mla_model)
    if mla:  # one latent row a token (its width as the pool packs it)
        heads, dim = 1, int(getattr(host_pool, "kv_cache_dim", 0)
                            or host_pool.kv_lora_rank + host_pool.qk_rope_head_dim)
    else:
        heads, dim = int(host_pool.head_num), int(host_pool.head_dim)
    # a pool with a page byte format of its own names it (SGLang's storage_format_tag)
    tag = getattr(host_pool, "storage_format_tag", None)
    kv_format = (f"sglang-{layout}{'-mla' if mla else ''}{f'-{tag}' if tag else ''}"
                 f"-pp{config.pp_rank}of{config.pp_size}")
    return Namespace(model=config.model_name or "unknown", dtype=dtype_name(host_pool.dtype),
                     num_layers=int(host_pool.layer_num), num_kv_heads=heads, head_dim=dim,
                     chunk_tokens=int(host_pool.page_size),
                     tp_size=1 if mla else config.tp_size, tp_rank=0 if mla else config.tp_rank,
                     kv_format=kv_format)


def _view(ptr: int, size: int) -> memoryview:
    """``size`` bytes of host memory at ``ptr`` (the host pool's, which outlives us)."""
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


class KvpoolHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """kvpool behind SGLang's ``HiCacheStorage`` (see the module doc). SGLang's factory
    makes it as ``KvpoolHiCacheStorage(storage_config, kwargs)``."""

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: dict[str, Any] | None = None) -> None:
        self.config = storage_config
        self.settings = HiCacheSettings.from_extra_config(dict(storage_config.extra_config or {}))
        self.counters = HiCacheCounters()
        self.namespace: Namespace | None = None
        self.mem_pool_host: Any = None
        self._reader = self.settings.client()
        self._writer = self.settings.client()
        self._backoff = Backoff(self.settings.retry_after_s)
        self._lock = threading.Lock()  # the counters and the back-off, from both threads
        self._page_bytes = 0
        self._digest = b""
        #: MHA pools list K and V of a page per layer ([K0, V0, K1, V1, ...]): sent as all
        #: K, then all V, the byte order of SGLang's flat data page
        self._split_kv = True
        #: the host pool's whole buffer as one view, and its address (pages are sliced
        #: out of it: 10x cheaper than a ctypes view a segment)
        self._whole: memoryview | None = None
        self._base = 0

    # -- setup ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.namespace = page_namespace(self.config, mem_pool_host)
        self._digest = self.namespace.digest
        self._split_kv = not self.config.is_mla_model
        try:
            _, sizes = mem_pool_host.get_page_buffer_meta(
                torch.arange(mem_pool_host.page_size, dtype=torch.int64))
        except (ValueError, AssertionError) as exc:  # a layout SGLang gives no page pointers
            raise ConfigError(f"kvpool HiCache backend: the host pool's layout "
                              f"{getattr(mem_pool_host, 'layout', '?')!r} is not supported "
                              f"({exc})") from None
        self._page_bytes = int(sum(sizes))
        buffer = getattr(mem_pool_host, "kv_buffer", None)
        if isinstance(buffer, torch.Tensor) and buffer.device.type == "cpu" \
                and buffer.is_contiguous():
            self._base = buffer.data_ptr()
            self._whole = _view(self._base, buffer.nbytes)
        log.info("kvpool HiCache backend: %s pages of %d bytes (%s) at %s",
                 self.namespace.kv_format, self._page_bytes, self.namespace.model,
                 self.settings.kvpool_url)

    def key(self, page_key: str) -> bytes:
        """The kvpool key of one SGLang page key (the same in every process)."""
        return bytes(xxhash.xxh3_128_digest(self._digest + page_key.encode("utf-8")))

    def _segments(self, host_indices: torch.Tensor, count: int) -> list[Page]:
        """Each page's bytes where they lie in the host pool, in the page's byte order."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per = len(ptrs) // count
        whole, base = self._whole, self._base
        end = base + (len(whole) if whole is not None else 0)
        pages: list[Page] = []
        for i in range(count):
            views: Page = [whole[p - base:p - base + s] if whole is not None
                           and base <= p and p + s <= end else _view(p, s)
                           for p, s in zip(ptrs[i * per:(i + 1) * per],
                                           sizes[i * per:(i + 1) * per], strict=True)]
            pages.append(views[0::2] + views[1::2] if self._split_kv and per > 1 else views)
        return pages

    # -- the guard around every pool call -------------------------------------------------

    def _allowed(self) -> bool:
        """Whether to call the pool now (not before the host pool is registered, nor while
        backing off)."""
        if self.namespace is None:
            return False
        with self._lock:
            if self._backoff.allow():
                return True
            self.counters.backed_off += 1
            return False

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.counters.errors += 1
            first = self._backoff.wait == 0
            wait = self._backoff.failed()
        if first:
            log.warning("kvpool HiCache backend: %s failed (%s: %s); pages are misses, the "
                        "pool is left alone for %.0f s", what, type(exc).__name__, exc, wait)

    def _succeeded(self) -> None:
        with self._lock:
            self._backoff.succeeded()

    # -- the v1 (zero-copy) interface ------------------------------------------------------

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of ``keys`` the pool holds (one round trip)."""
        with self._lock:
            self.counters.lookups += 1
            self.counters.pages_looked_up += len(keys)
        if not keys or not self._allowed():
            return 0
        try:
            # never more than was asked, whatever a node said (the client checks it too)
            found = min(len(keys), self._reader.lookup([self.key(k) for k in keys]))
        except (KvpoolError, OSError) as exc:
            self._failed("lookup", exc)
            return 0
        self._succeeded()
        with self._lock:
            self.counters.pages_hit += found
        return found

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Each page straight into its place in the host pool; True where it arrived whole
        and verified."""
        if not keys or not self._allowed():
            return [False] * len(keys)
        start = time.perf_counter()
        sinks = self._segments(host_indices, len(keys))
        kv_keys = [self.key(k) for k in keys]
        try:
            try:
                got = self._reader.get_many_into(kv_keys, sinks)
            except BufferTooSmallError:  # a value of a foreign size: find it one by one
                got = [self._get_one(key, sink) for key, sink in zip(kv_keys, sinks,
                                                                     strict=True)]
        except (KvpoolError, OSError) as exc:
            self._failed("get", exc)
            return [False] * len(keys)
        self._succeeded()
        done = [n == self._page_bytes for n in got]
        loaded = sum(done)
        with self._lock:
            self.counters.pages_loaded += loaded
            self.counters.bytes_loaded += loaded * self._page_bytes
            self._recent("prefetch", loaded, time.perf_counter() - start)
        return done

    def _get_one(self, key: bytes, sink: Page) -> int | None:
        try:
            return self._reader.get_into(key, sink)
        except BufferTooSmallError:
            return None

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the pages the pool lacks, sent from the host pool; True for each page the
        pool now has."""
        if not keys or not self._allowed():
            return [False] * len(keys)
        start = time.perf_counter()
        kv_keys = [self.key(k) for k in keys]
        try:
            present = self._writer.exists_many(kv_keys)
            todo = [i for i, have in enumerate(present) if not have]
            if todo:
                pages = self._segments(host_indices, len(keys))
                self._writer.put_many([kv_keys[i] for i in todo], [pages[i] for i in todo],
                                      num_tokens=self.mem_pool_host.page_size)
        except (KvpoolError, OSError) as exc:
            self._failed("put", exc)
            return [False] * len(keys)
        self._succeeded()
        with self._lock:
            self.counters.pages_stored += len(todo)
            self.counters.pages_skipped += len(keys) - len(todo)
            self.counters.bytes_stored += len(todo) * self._page_bytes
            self._recent("backup", len(todo), time.perf_counter() - start)
        return [True] * len(keys)

    def _recent(self, kind: str, pages: int, seconds: float) -> None:
        recent = self.counters.recent
        recent[f"{kind}_pgs"].append(pages)
        recent[f"{kind}_bandwidth"].append(
            pages * self._page_bytes / seconds / 1e9 if seconds > 0 else 0.0)

    # -- the older, copying interface (SGLang's abstract methods) --------------------------

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        got = self.batch_get([key], [target_location] if target_location is not None
                             else None)
        return got[0] if isinstance(got, list) else None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Each page into its flat tensor of ``target_locations`` (None where missing)."""
        if target_locations is None or not self._allowed():
            return [None] * len(keys)
        targets: Sequence[torch.Tensor] = target_locations
        try:
            got = [self._get_one(self.key(k), [_tensor_bytes(t)])
                   for k, t in zip(keys, targets, strict=True)]
        except (KvpoolError, OSError) as exc:
            self._failed("get", exc)
            return [None] * len(keys)
        self._succeeded()
        out: list[torch.Tensor | None] = [t if n == t.nbytes else None
                                          for n, t in zip(got, targets, strict=True)]
        with self._lock:
            self.counters.pages_loaded += sum(t is not None for t in out)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store each flat page tensor of ``values``; True if the pool now has them all."""
        if values is None or not self._allowed():
            return False
        kv_keys = [self.key(k) for k in keys]
        try:
            present = self._writer.exists_many(kv_keys)
            todo = [i for i, have in enumerate(present) if not have]
            if todo:
                self._writer.put_many([kv_keys[i] for i in todo],
                                      [_tensor_bytes(values[i]) for i in todo])
        except (KvpoolError, OSError) as exc:
            self._failed("put", exc)
            return False
        self._succeeded()
        with self._lock:
            self.counters.pages_stored += len(todo)
            self.counters.pages_skipped += len(keys) - len(todo)
        return True

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the rest ----------------------------------------------------------------------

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the batches since the last call (None where that
        class does not import)."""
        with self._lock:
            recent = self.counters.recent
            self.counters.recent = {name: [] for name in recent}
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:  # its module pulls in much of SGLang's server
            return None
        metrics = StorageMetrics()
        for name, values in recent.items():
            getattr(metrics, name).extend(values)
        return metrics

    def close(self) -> None:
        self._reader.close()
        self._writer.close()


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ConfigError("kvpool HiCache backend: pages must be contiguous host tensors")
    view: memoryview = tensor.view(torch.uint8).numpy().data.cast("B")
    return view
