"""The worker side of kvpool's vLLM connector (the model runner's process): the caches'
layout, the namespace it tells the scheduler, loads into the blocks (async, sync or by
layer) and, through :class:`~kvpool.gpu._vllm_saves.Saves`, saves out of them; what it
reports back to vLLM each step."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, replace
from typing import Any

import torch

from kvpool.client import Client, KvpoolError
from kvpool.gpu._vllm_layout import VllmCacheWrite, _namespace, _own_layers, _scaled_label
from kvpool.gpu._vllm_saves import Saves
from kvpool.gpu._vllm_state import (
    ConnectorState,
    KvpoolConnectorMetadata,
    KvpoolHandshake,
    _Load,
)
from kvpool.gpu.connector import PagedKVConnector
from kvpool.gpu.layout import KVLayout
from kvpool.gpu.paged import Scatter, scatter
from kvpool.gpu.threads import cpus_for_io, move_to, nicer
from kvpool.placement.keys import ChunkHasher
from kvpool.protocol.errors import ConfigError

__all__ = ["WorkerSide"]

log = logging.getLogger("kvpool.vllm")


class WorkerSide:
    def __init__(self, state: ConnectorState, kv_cache_config: Any) -> None:
        self.state = state
        self._kv_cache_config = kv_cache_config
        # one thread and connector for loads, one for saves (a save backlog never queues
        # ahead of a load; the two share one client, call by call)
        self._load_io: ThreadPoolExecutor | None = None
        self._client: Client | None = None
        self.loader: PagedKVConnector | None = None
        self.saves = Saves(state, None, None, self._kernel_ids)
        self._pending: Future[set[int]] | None = None
        #: async loads in flight, by request: their failed blocks when done
        self._loading: dict[str, Future[set[int]]] = {}
        self._load_errors: set[int] = set()
        #: this step's requests whose load failed: tokens valid before the first failure
        self._valid_until: dict[str, int] = {}
        self._lock = threading.Lock()

    # -- at start ---------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        state = self.state
        layout = state.layout
        if layout is None or not state.active:
            return
        try:
            names = _own_layers(kv_caches, layout, self._kv_cache_config)
            caches = [kv_caches[n] for n in names]
            if layout.kind == "mla":  # vLLM's MLA view is [blocks, 1, block_size, latent]
                caches = [c.squeeze(1) if c.dim() == 4 else c for c in caches]
            layout = self._worker_layout(layout, names, caches)
        except ConfigError as exc:
            log.error("kvpool connector: disabled, every request computes its own KV: %s", exc)
            state.layout = None
            return
        state.layout = layout
        state.namespace = _namespace(state.vllm_config, state.model_id, state.chunk_tokens,
                                     layout, state.tp_rank)
        state.hasher = ChunkHasher(state.namespace)
        cpus = cpus_for_io(state.settings.io_cpus, caches[0].device.type == "cpu")
        self._load_io, save_io = _io_threads(caches[0].device, state.settings.save_nice, cpus)
        # one client for both threads (its calls are serialised): what one learns of a
        # node (down, left behind as hung) the other uses at once
        self._client = state.settings.client()
        saver = None
        try:  # the connector checks the tensors against the layout
            self.loader = self._load_io.submit(self._open, layout, caches, True).result()
            if layout.kind != "mla" or state.tp_rank == 0:  # MLA: one writer of the latents
                saver = save_io.submit(self._open, layout, caches, False).result()
        except (KvpoolError, ValueError) as exc:
            log.error("kvpool connector: disabled, every request computes its own KV: %s", exc)
            self.loader = None
            state.layout = None
            self.saves = Saves(state, save_io, None, self._kernel_ids)
            return
        self.saves = Saves(state, save_io, saver, self._kernel_ids)
        staged = sum(p.staging_nbytes for p in (self.loader, saver) if p is not None)
        ratio = self._kernel_ratio
        log.info("kvpool connector: %d layers of %s blocks%s, %s chunks of %d tokens (%s, "
                 "model id %r, %s loads) from %s; staging %.1f MiB on %s", len(names),
                 layout.kind, f" ({ratio} kernel blocks a block)" if ratio > 1 else "",
                 layout.chunk_format, state.chunk_tokens, layout.dtype_id, state.model_id,
                 state.settings.load_mode, state.settings.kvpool_url, staged / 2**20,
                 caches[0].device)

    def _worker_layout(self, layout: KVLayout, names: Sequence[str],
                       caches: Sequence[torch.Tensor]) -> KVLayout:
        """The layout of the caches the worker was handed, from the one the config gave:
        vLLM's kernel-block split (a backend that reads smaller blocks than the scheduler
        hands out gets each block as ``ratio`` consecutive kernel blocks), the number of
        layers with a cache of their own, the KV scales of a quantized cache."""
        if not caches:
            raise ConfigError("kvpool connector: vLLM registered no attention KV cache")
        first = caches[0]
        block_dim = 1 if layout.kind == "mla" else 2
        kernel = int(first.shape[block_dim]) if first.dim() > block_dim else layout.block_size
        if kernel != layout.block_size:
            if kernel < 1 or layout.block_size % kernel:
                raise ConfigError(f"kvpool connector: the caches hold blocks of {kernel} "
                                  f"tokens, which do not divide vLLM's {layout.block_size}")
            layout = replace(layout, block_size=kernel)
        if len(caches) != layout.num_layers:
            if layout.layer_range is not None:
                raise ConfigError(f"kvpool connector: {len(caches)} KV caches for the "
                                  f"{layout.num_layers} layers of this pipeline stage")
            layout = replace(layout, num_layers=len(caches))
        if layout.dtype_label is not None:
            layout = replace(layout, dtype_label=_scaled_label(
                layout.dtype_label, self.state.vllm_config, names))
        return layout

    def handshake(self) -> KvpoolHandshake:
        """This worker's key namespace, for the scheduler (None: disabled)."""
        if not self.state.active:
            return KvpoolHandshake(None)
        return KvpoolHandshake(asdict(self.state.namespace))

    @property
    def _kernel_ratio(self) -> int:
        """Kernel blocks a scheduler block holds (vLLM splits blocks for some backends:
        the worker's layout then has the kernel blocks' size)."""
        layout = self.state.layout
        return self.state.block_size // layout.block_size if layout is not None else 1

    def _kernel_ids(self, block_ids: Sequence[int]) -> list[int]:
        """The caches' (kernel) block ids of the scheduler's ``block_ids``."""
        r = self._kernel_ratio
        if r == 1:
            return list(block_ids)
        return [b * r + i for b in block_ids for i in range(r)]

    def _open(self, layout: KVLayout, caches: Sequence[torch.Tensor], loads: bool
              ) -> PagedKVConnector:
        """On an I/O thread: the connector it drives, over the worker's one client
        (``loads``: it loads; a saver's connector makes no write batch)."""
        if hasattr(os, "sched_getaffinity"):  # (on one CPU the client copies on it alone)
            log.info("kvpool connector: %s thread on CPUs %s", threading.current_thread().name,
                     ",".join(map(str, sorted(os.sched_getaffinity(0)))))
        # canonical cpu_attn chunks go through staging (K is transposed on the way, into
        # AMX tiles by vLLM's own op); the engine's own format goes straight between the
        # pool and the blocks
        write: Scatter = VllmCacheWrite(caches) if layout.kind == "cpu_attn_amx" \
            and not layout.engine_format else scatter
        assert self._client is not None
        return PagedKVConnector(self._client, layout, list(caches), self.state.namespace,
                                staging_slots=self.state.settings.staging_slots,
                                scatter=write, batch_loads=loads)

    # -- each step --------------------------------------------------------------------------

    def start_load(self, meta: object) -> None:
        if not isinstance(meta, KvpoolConnectorMetadata) or not meta.loads:
            return
        mode = self.state.settings.load_mode
        if self.loader is None or self._load_io is None:  # promised: recompute
            if mode == "async":
                for load in meta.loads:
                    self._loading[load.req_id] = _done(self._blocks(load, load.start))
                    self.state.stats.data["load_errors"] += 1
            else:
                self._fail_loads(meta.loads)
            return
        after = self._engine_event()
        if mode == "async":  # each request is scheduled once its own load is done
            for load in meta.loads:
                self._loading[load.req_id] = self._load_io.submit(self._load_one, load, after)
            return
        pending = self._load_io.submit(self._load_all, meta.loads, after)
        if mode == "sync":
            self._finish(pending)
        else:
            self._pending = pending

    def wait_for_layer_load(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._finish(pending)

    def queue_saves(self, meta: object) -> None:
        """Queue this step's saves on the save thread and return (see :class:`Saves`)."""
        self.wait_for_layer_load()  # a forward that ran no attention layer
        valid_until, self._valid_until = self._valid_until, {}
        if isinstance(meta, KvpoolConnectorMetadata) and meta.saves:
            # (this step's failed loads matter to this step's saves only)
            self.saves.queue(meta.saves, valid_until, self._engine_event)

    def finished(self, finished_req_ids: set[str]
                 ) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose blocks the scheduler held for a save, now saved; requests
        whose async load is done, loaded or not: failed blocks are reported by
        :meth:`load_errors` in the same step)."""
        recving: set[str] = set()
        for req_id, loading in list(self._loading.items()):
            if loading.done():
                del self._loading[req_id]
                failed = loading.result()  # _load_one never raises
                if failed:
                    with self._lock:
                        self._load_errors |= failed
                recving.add(req_id)
        if recving:
            self._engine_waits()
        sending = self.saves.done(finished_req_ids)
        return sending or None, recving or None

    def load_errors(self) -> set[int]:
        with self._lock:
            failed, self._load_errors = self._load_errors, set()
        return failed

    def _engine_event(self) -> Any:
        """On CUDA, an event recorded on the engine's stream (on the engine's thread): an
        I/O thread waits for it before it writes a block that the engine's queued
        kernels may still read, or reads blocks its forward is still writing. No host
        sync on the engine's thread."""
        paged = self.loader or self.saves.saver
        if paged is None or paged.device.type != "cuda":
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(paged.device))
        return event

    def _engine_waits(self) -> None:
        """On CUDA, the engine's stream waits (on the device) for the loads queued on the
        loader's side stream."""
        paged = self.loader
        if paged is not None and paged.stream is not None:
            torch.cuda.current_stream(paged.device).wait_stream(paged.stream)

    def shutdown(self) -> None:
        for io, paged in ((self._load_io, self.loader), (self.saves.io, self.saves.saver)):
            if io is not None:
                if paged is not None:  # after what is queued (saves finish first)
                    io.submit(paged.close).result()
                io.shutdown(wait=True)
        if self._client is not None:
            self._client.close()

    # -- loads (on the load thread) -------------------------------------------------------

    def _finish(self, pending: Future[set[int]]) -> None:
        failed = pending.result()  # _load_all never raises
        self._engine_waits()
        if failed:
            with self._lock:
                self._load_errors |= failed

    def _fail_loads(self, loads: Sequence[_Load]) -> None:
        with self._lock:
            for load in loads:
                self._load_errors |= self._blocks(load, load.start)
                self._valid_until[load.req_id] = load.start

    def _blocks(self, load: _Load, loaded: int) -> set[int]:
        """The blocks of ``load`` past ``loaded`` tokens: promised, not loaded."""
        b = self.state.block_size
        return set(load.block_ids[max(loaded, load.start) // b : load.end // b])

    def _load_one(self, load: _Load, after: Any) -> set[int]:
        """Load one request's chunks; the blocks promised and not loaded (never raises)."""
        return self._load(load, after)[1]

    def _load(self, load: _Load, after: Any) -> tuple[int, set[int]]:
        assert self.loader is not None
        state = self.state  # (its stats are read at each count: vLLM takes them meanwhile)
        if after is not None:
            after.synchronize()  # the engine's queued kernels are done with these blocks
        started = time.perf_counter()
        loaded = 0
        if not state.backoff.allow():  # promised before the pool failed: recompute
            state.stats.data["backed_off"] += 1
        else:
            try:
                loaded = self.loader.load(load.tokens, self._kernel_ids(load.block_ids),
                                          max_tokens=load.end, skip_tokens=load.start)
                state.backoff.succeeded()
            except Exception as exc:  # never into the engine: the blocks are recomputed
                state.once("load", "a load failed, its tokens are recomputed: %s", exc)
                if isinstance(exc, KvpoolError):
                    state.failed("load")
        state.stats.data["load_s"] += time.perf_counter() - started
        state.stats.data["tokens_loaded"] += max(0, min(loaded, load.end) - load.start)
        if loaded >= load.end:
            return loaded, set()
        state.stats.data["load_errors"] += 1
        return loaded, self._blocks(load, loaded)

    def _load_all(self, loads: Sequence[_Load], after: Any) -> set[int]:
        failed: set[int] = set()
        for load in loads:
            loaded, missed = self._load(load, after)
            after = None
            if missed:
                failed |= missed
                # its blocks past this point hold nothing valid until vLLM recomputes them
                self._valid_until[load.req_id] = max(loaded, load.start)
        return failed


def _io_threads(device: torch.device, save_nice: int = 0, cpus: set[int] | None = None
                ) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
    """The load thread and the save thread, each on ``device`` where it is a GPU (with
    every GPU visible, a thread that never set it would allocate and make its streams on
    GPU 0, not on its tensor-parallel rank's) and on ``cpus`` where given (the
    connector's ``io_cpus``); the save thread ``save_nice`` nicer than the thread that
    starts it (the engine's), as are the threads it starts in turn (its connector's
    copier: Linux threads inherit their maker's niceness and CPUs)."""
    def on_device() -> None:
        move_to(cpus or set())
        if device.type == "cuda":
            torch.cuda.set_device(device)

    def saves() -> None:
        on_device()
        nicer(save_nice)

    return (ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-load",
                               initializer=on_device),
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-save",
                               initializer=saves))


def _done(result: set[int]) -> Future[set[int]]:
    """A future already holding ``result``."""
    future: Future[set[int]] = Future()
    future.set_result(result)
    return future
