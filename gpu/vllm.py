"""vLLM KV connector: vLLM saves prompt KV to kvpool and loads cached prefixes back.

Load it through vLLM's connector factory (vLLM >= 0.32, V1 engine)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvpoolConnector",
        "kv_connector_module_path": "kvpool.gpu.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvpool_url": "kvpool://127.0.0.1:7700"}}'

Scheduler side (vLLM's EngineCore process): ``get_num_new_matched_tokens``
hashes the prompt's full chunks with kvpool's :class:`ChunkHasher` and asks
the cluster once (``lookup``) how many leading chunks it holds; the tokens
past vLLM's own prefix cache are promised to the worker, which loads them
before the forward. When a request's prefill completes, its full prompt
chunks are saved (those the pool lacks: one ``exists`` round trip).

Worker side (the model runner's process): ``register_kv_caches`` works out
the paged layout from the attention backend (``CPU_ATTN`` with its ``vec`` or
``vec16`` kernels -> the ``cpu_attn`` kind, with ``amx`` -> ``cpu_attn_amx``)
and checks the tensors against it; loads and saves go through
:class:`~kvpool.gpu.PagedKVConnector` on I/O threads. By default chunks stay
in kvpool's canonical, engine-neutral layout and load into any engine (an AMX
host and an AVX2 host share them); ``chunk_format="engine"`` stores vLLM's own
block bytes instead (no conversion: loads go straight into the blocks, one
request for up to 32 chunks), under keys of their own that only engines with
the same kernels and block size read.

Loads (``load_mode``): ``"async"`` (default) tells vLLM the load is asynchronous:
the request waits out its load between steps while the rest of the batch runs, and
``get_finished`` reports it done; ``"sync"`` loads before the forward starts;
``"layer"`` starts the load in ``start_load_kv`` and waits for it in the first
``wait_for_layer_load``, so the load overlaps the work before the first attention
layer (vLLM then uses piecewise CUDA graphs: a FULL graph's replay never calls
``wait_for_layer_load``). A chunk's checksum covers all its layers, so no layer can
be used before its whole chunk has arrived: ``"layer"`` cannot go finer.

Saves leave the step: ``wait_for_save`` queues them on a thread of their own (at most
``save_queue_chunks`` chunks; past that a save is skipped and counted); a finished
request's blocks are held (``request_finished`` returns True) until ``get_finished``
reports its save done, and a preempted request's save is waited for before its blocks
are written again (``handle_preemptions``).

Failures never reach the engine: a node error, a missing or corrupt chunk is
a miss, counted and logged once; blocks promised but not loaded are reported
by ``get_block_ids_with_load_errors`` so that vLLM, with
``kv_load_failure_policy="recompute"``, recomputes them (with vLLM's default
``"fail"`` the request fails instead: set ``recompute``). After a failed pool
call each side backs off (:class:`Backoff`, ``retry_after_s``): a hung node
would otherwise cost every request, or every step, ``timeout_s``.

GPU backends (FlashAttention, FlashInfer, Triton, ...): vLLM >= 0.32 hands every
one of them the same per-layer view, ``[blocks, heads, block_size, 2*head_dim]``
with a token's K then V in the last dimension, in a physical order vLLM resolves
(``KVCacheLayout``): the ``bhnc`` kind, read and written through those strides,
staged through pinned memory on a side CUDA stream. An I/O thread waits for an event
the engine's thread recorded on its stream before it writes into blocks (a freed block
may still be read by the previous step's kernels) or reads them (the forward that wrote
them); the engine's stream waits on the loader's stream once a load is done; kvpool's
threads set the caches' device. This path is checked on the CPU against vLLM's own view
construction (``create_kv_cache_views``, every ``KVCacheLayout``) and the backends' own
K/V split; it has not run on a GPU.

MLA models (off the CPU): vLLM's ``[blocks, 1, block_size, latent]`` views are the
``mla`` kind, one namespace for every TP rank, saved by rank 0. fp8 KV caches (``fp8``,
``fp8_e4m3``, ``fp8_e5m2``: uint8 tensors, a K and a V scale a layer) move as their
bytes, the format and a digest of the scales in the namespace's dtype. A backend that
splits blocks into kernel blocks gets each block id as its kernel blocks. The worker
takes vLLM's one full-attention (or MLA) cache group, this stage's layers, one per
tensor (no draft-model layers, no layer reading another's cache), and hands its
namespace to the scheduler through vLLM's handshake before the first request.

Not handled (such requests neither load nor save; counted as ``skipped``):
multimodal inputs (their placeholder tokens do not identify the images),
LoRA adapters, prompts given as embeddings. Refused at start (the connector
then stays idle, logged, and vLLM runs without it): quantized KV caches with scales
per token or per block (``*_per_token_head``, ``nvfp4``, ...), fp8 and MLA on vLLM's
CPU backend, hybrid models (several KV cache groups), and CPU attention kernels other
than ``vec``/``vec16``/``amx``. Pipeline parallelism: each stage saves and loads its
own layers (their range is in the namespace); the scheduler looks up the first stage's
chunks, so a chunk another stage lacks is a failed load there, recomputed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvpool.client import Client, KvpoolError
from kvpool.gpu.backoff import Backoff
from kvpool.gpu.connector import DEFAULT_STAGING_SLOTS, PagedKVConnector
from kvpool.gpu.layout import KVLayout, LayoutKind, dtype_name
from kvpool.gpu.paged import Scatter, scatter
from kvpool.gpu.settings import settings_from
from kvpool.placement.keys import DEFAULT_CHUNK_TOKENS, ChunkHasher, Namespace
from kvpool.protocol.errors import ConfigError

__all__ = ["VllmCacheWrite", "Backoff", "KvpoolConnector", "KvpoolConnectorMetadata",
           "KvpoolConnectorStats", "KvpoolSettings", "default_model_id"]

log = logging.getLogger("kvpool.vllm")


def _log_where_vllm_logs() -> None:
    """kvpool's lines (the connector's start line, a node marked down) where vLLM prints
    its own, in its format: vLLM configures its ``vllm`` logger only, so under ``vllm
    serve`` kvpool's INFO lines went nowhere. Left alone where the application gave the
    ``kvpool`` logger a handler, or vLLM's logging is off (``VLLM_CONFIGURE_LOGGING=0``)."""
    ours, theirs = logging.getLogger("kvpool"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False  # (a root handler would print each line twice)


_LOAD_MODES = ("async", "sync", "layer")
#: quantized KV caches served: one byte an element with one scale per layer for K and one
#: for V (per-token or per-block scales live beside the blocks: not mapped)
_FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")
_CHUNK_FORMATS = ("canonical", "engine")


@dataclass(frozen=True, slots=True)
class KvpoolSettings:
    """``kv_connector_extra_config``; only ``kvpool_url`` is needed."""

    #: a node URL, or a comma-separated seed list (``kvpool://`` optional)
    kvpool_url: str
    #: the tenant token (default: ``$KVPOOL_TOKEN``)
    token: str | None = None
    #: "tenant" (the token's own), "shared" (readable by every tenant) or "raw"
    scope: str = "tenant"
    #: tokens per chunk: a multiple of vLLM's block size; engines that share chunks agree
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    #: the model in the key namespace (default: :func:`default_model_id`)
    model_id: str = ""
    #: seconds a pool call may take before it is a miss (the engine never waits longer)
    timeout_s: float = 5.0
    #: after a pool call fails, the pool is left alone this long (doubling while it keeps
    #: failing, up to 12x): each call to a hung node would cost the engine ``timeout_s``
    retry_after_s: float = 5.0
    #: "async", "sync" or "layer" (see the module doc)
    load_mode: str = "async"
    #: chunks in flight at once per load or save
    staging_slots: int = DEFAULT_STAGING_SLOTS
    #: chunks queued or being saved at once; a save past it is skipped (counted as
    #: ``saves_skipped``): a pool that falls behind costs cache hits, never memory or time
    save_queue_chunks: int = 256
    #: same-host shared memory: None = when the node offers it
    shm: bool | None = None
    #: "canonical" (engine-neutral chunks: any engine reads them) or "engine" (vLLM
    #: CPU_ATTN's own block bytes: no conversion, loads straight into the blocks, but
    #: only vLLM CPU engines with the same block size share them)
    chunk_format: str = "canonical"

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> KvpoolSettings:
        """ConfigError naming the bad key (vLLM then fails at start with that line)."""
        settings = settings_from(
            cls, extra, owner="kvpool connector", keys="kv_connector_extra_config key(s)",
            missing_url='kv_connector_extra_config needs "kvpool_url" '
                        '(e.g. "kvpool://127.0.0.1:7700")')
        if settings.chunk_format not in _CHUNK_FORMATS:
            raise ConfigError(f"kvpool connector: chunk_format must be one of "
                              f"{_CHUNK_FORMATS}, got {settings.chunk_format!r}")
        if settings.load_mode not in _LOAD_MODES:
            raise ConfigError(f"kvpool connector: load_mode must be one of {_LOAD_MODES}, got "
                              f"{settings.load_mode!r}")
        for name in ("chunk_tokens", "staging_slots", "save_queue_chunks"):
            value = getattr(settings, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"kvpool connector: {name} must be an integer >= 1, got "
                                  f"{value!r}")
        return settings

    def client(self) -> Client:
        return Client(self.kvpool_url, token=self.token,  # one node, or comma-separated seeds
                      scope=self.scope, shm=self.shm,
                      timeout=self.timeout_s, connect_timeout=min(2.0, self.timeout_s),
                      client_name="kvpool-vllm")


def default_model_id(config: Any, name_or_path: str = "") -> str:
    """The model id a namespace records for ``config`` (a transformers config): its
    ``kvpool_model_id`` attribute if the model folder's config.json has one (the SmolLM2
    folder of :func:`kvpool.examples.models.load_smollm2` does), else ``name_or_path``. The
    transformers adapter uses the same rule, so the two engines share chunks."""
    return str(getattr(config, "kvpool_model_id", None) or name_or_path
               or getattr(config, "name_or_path", "") or "")


@dataclass
class _Load:
    req_id: str
    tokens: list[int]  #: the prompt up to ``end``
    block_ids: list[int]
    start: int  #: tokens vLLM computed itself (its prefix cache): not written
    end: int  #: load up to here


@dataclass
class _Save:
    req_id: str
    tokens: list[int]  #: the prompt's full chunks
    block_ids: list[int]


@dataclass
class KvpoolConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the worker does this step: loads (before the forward, or between steps with
    ``load_mode="async"``), saves (after it, off the step), and the preempted requests
    whose saves must finish before their blocks are written again."""

    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)
    flush: set[str] = field(default_factory=set)


@dataclass
class KvpoolHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """What a worker tells the scheduler at start (vLLM's handshake, before any request):
    the key namespace its chunks are stored under (``Namespace`` fields), which only the
    worker can know in full (its KV scales, the layers it was handed); None: its connector
    is disabled, so the scheduler promises no loads and asks no saves."""

    namespace: dict[str, Any] | None = None


_COUNTERS = ("lookups", "lookup_errors", "tokens_looked_up", "tokens_hit", "tokens_loaded",
             "tokens_stored", "load_errors", "save_errors", "load_s", "save_s", "skipped",
             "backed_off", "saves_skipped")


@dataclass
class KvpoolConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """The worker's counters since the last report (vLLM aggregates and logs them)."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in _COUNTERS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(_COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KvpoolConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(value, 4) if isinstance(value, float) else value
                for name, value in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass
class _Request:
    prompt: list[int]
    block_ids: list[int]
    #: False for requests whose token ids do not say what their KV is (see the module doc)
    usable: bool = True
    saved: bool = False


def _usable(request: Any) -> bool:
    """Whether the pool may serve ``request``: token ids, no multimodal input, no LoRA."""
    return not (getattr(request, "mm_features", None) or getattr(request, "lora_request", None)
                or getattr(request, "prompt_token_ids", None) is None)


class KvpoolConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """kvpool behind vLLM's V1 KV connector interface (see the module doc)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_where_vllm_logs()
        transfer = self._kv_transfer_config
        self.settings = KvpoolSettings.from_extra_config(
            dict(transfer.kv_connector_extra_config or {}))
        self.block_size = int(vllm_config.cache_config.block_size)
        chunk = self.settings.chunk_tokens
        if chunk % self.block_size:
            raise ConfigError(f"kvpool connector: chunk_tokens ({chunk}) must be a multiple of "
                              f"vLLM's block size ({self.block_size}); set --block-size or "
                              "chunk_tokens")
        self.chunk_tokens = chunk
        self.load_enabled = bool(transfer.is_kv_consumer)
        self.save_enabled = bool(transfer.is_kv_producer)
        #: the paged layout the attention backend gives this engine's blocks (checked
        #: against the tensors when they are registered); None: not one mapped here
        self.layout: KVLayout | None = None
        try:  # both sides decide alike: the scheduler never promises what no worker loads
            self.layout = _layout(vllm_config, self.settings.chunk_format)
        except ConfigError as exc:
            log.error("kvpool connector: idle, every request computes its own KV: %s", exc)
            self.load_enabled = self.save_enabled = False
        model = vllm_config.model_config
        self.model_id = self.settings.model_id or default_model_id(model.hf_config,
                                                                   str(model.model))
        self._tp_rank = _tp_rank(vllm_config)
        #: canonical chunks are the same whatever the kind; the engine's own are not. The
        #: worker's is the final word: the scheduler takes it from vLLM's handshake
        self.namespace = _namespace(vllm_config, self.model_id, chunk, self.layout,
                                    self._tp_rank)
        self.hasher = ChunkHasher(self.namespace)
        self.stats = KvpoolConnectorStats()
        self._logged: set[str] = set()
        #: this process's view of the pool's health (scheduler: lookups; worker: I/O)
        self.backoff = Backoff(self.settings.retry_after_s)
        # scheduler side
        self._client: Client | None = None
        self._matched: dict[str, int] = {}
        self._loads: dict[str, _Load] = {}
        self._requests: dict[str, _Request] = {}
        #: requests whose save was asked of the worker: their blocks are held when they
        #: finish until the worker reports the save done (``get_finished``)
        self._save_issued: set[str] = set()
        # worker side: one thread and connector for loads, one for saves (a save backlog
        # never queues ahead of a load; the two share one client, call by call)
        self._load_io: ThreadPoolExecutor | None = None
        self._save_io: ThreadPoolExecutor | None = None
        self._worker_client: Client | None = None
        self._loader: PagedKVConnector | None = None
        self._saver: PagedKVConnector | None = None
        self._pending: Future[set[int]] | None = None
        #: async loads in flight, by request: their failed blocks when done
        self._loading: dict[str, Future[set[int]]] = {}
        #: the latest save of each request still queued or running
        self._saving: dict[str, Future[None]] = {}
        #: requests whose save the scheduler asked for (it holds their blocks when they
        #: finish); and those finished, reported once their save is done
        self._save_owed: set[str] = set()
        self._finishing: set[str] = set()
        self._queued_chunks = 0
        self._load_errors: set[int] = set()
        #: this step's requests whose load failed: tokens valid before the first failure
        self._valid_until: dict[str, int] = {}
        self._lock = threading.Lock()

    # -- helpers ----------------------------------------------------------------------------

    def _once(self, what: str, message: str, *args: Any) -> None:
        """Log a failure the first time it happens (then it is only counted)."""
        if what not in self._logged:
            self._logged.add(what)
            log.warning("kvpool connector: " + message, *args)

    def _failed(self, what: str) -> None:
        """A pool call failed: leave the pool alone for a while (logged each time)."""
        wait = self.backoff.failed()
        log.warning("kvpool connector: the pool failed a %s; no pool calls for %.0f s "
                    "(requests compute their own KV meanwhile)", what, wait)

    def _scheduler_client(self) -> Client:
        if self._client is None:
            self._client = self.settings.client()
        return self._client

    # -- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` the pool holds (full chunks, leaving the last
        prompt token to compute); one lookup round trip, no side effect on the pool."""
        if not self.load_enabled:
            return 0, False
        if not _usable(request):
            self.stats.data["skipped"] += 1
            return 0, False
        tokens = request.prompt_token_ids
        limit = (len(tokens) - 1) // self.chunk_tokens * self.chunk_tokens
        if limit <= num_computed_tokens:
            return 0, False
        if not self.backoff.allow():
            self.stats.data["backed_off"] += 1
            return 0, False
        self.stats.data["lookups"] += 1
        self.stats.data["tokens_looked_up"] += limit
        try:
            found = self._scheduler_client().lookup(self.hasher.keys(tokens[:limit]))
        except KvpoolError as exc:
            self.stats.data["lookup_errors"] += 1
            self._once("lookup", "lookup failed, treating it as a miss: %s", exc)
            self._failed("lookup")
            return 0, False
        self.backoff.succeeded()
        # never more than was asked, whatever a node said (the client checks it too)
        hit = min(found, limit // self.chunk_tokens) * self.chunk_tokens
        self.stats.data["tokens_hit"] += hit
        if hit <= num_computed_tokens:
            return 0, False
        self._matched[request.request_id] = num_computed_tokens
        return hit - num_computed_tokens, self.settings.load_mode == "async"

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        start = self._matched.pop(request.request_id, 0)
        end = start + num_external_tokens
        self._loads[request.request_id] = _Load(
            request.request_id, list(request.prompt_token_ids[:end]),
            list(blocks.get_block_ids()[0]), start, end)

    def build_connector_meta(self, scheduler_output: Any) -> KvpoolConnectorMetadata:
        meta = KvpoolConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.prompt_token_ids is None:
                continue
            state = _Request(list(new.prompt_token_ids), list(new.block_ids[0]),
                             usable=not (new.mm_features or new.lora_request))
            self._requests[new.req_id] = state
            self._add_load(meta, new.req_id, state)
            self._maybe_save(meta, new.req_id, state,
                             new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            known = self._requests.get(req_id)
            if known is None:
                continue
            state = known
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                if new_ids is not None:  # a resumed request gets all of its blocks anew
                    state.block_ids = list(new_ids[0])
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            self._add_load(meta, req_id, state)
            self._maybe_save(meta, req_id, state,
                             cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        if self.settings.load_mode == "async":
            # the request waits (WAITING_FOR_REMOTE_KVS) until the worker reports its load
            # done; it is scheduled afterwards with the blocks it was given now
            meta.loads.extend(self._loads.values())
        self._loads.clear()  # a load not scheduled this step was never started
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        meta.flush = {req_id for req_id in preempted if req_id in self._save_issued}
        return meta

    def _add_load(self, meta: KvpoolConnectorMetadata, req_id: str, state: _Request) -> None:
        load = self._loads.pop(req_id, None)
        if load is not None:
            load.block_ids = list(state.block_ids)
            meta.loads.append(load)

    def _maybe_save(self, meta: KvpoolConnectorMetadata, req_id: str, state: _Request,
                    computed: int) -> None:
        """Save the prompt's full chunks in the step its prefill completes."""
        if state.saved or computed < len(state.prompt):
            return
        state.saved = True
        full = len(state.prompt) // self.chunk_tokens * self.chunk_tokens
        if self.save_enabled and state.usable and full:
            meta.saves.append(_Save(req_id, state.prompt[:full], list(state.block_ids)))
            self._save_issued.add(req_id)

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks the worker failed to load are recomputed: their request saves again once
        its prefill is complete anew (the worker did not save past a failed block)."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        for state in self._requests.values():
            if state.saved and not invalid.isdisjoint(state.block_ids):
                state.saved = False

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """True (hold the blocks) if a save of the request was asked: the worker reads them
        off the step and reports the save done through ``get_finished``."""
        for table in (self._requests, self._loads, self._matched):
            table.pop(request.request_id, None)
        saving = request.request_id in self._save_issued
        self._save_issued.discard(request.request_id)
        return saving, None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """``load_mode="layer"`` waits for its load in ``wait_for_layer_load``, which a
        FULL CUDA-graph replay never runs: vLLM then uses piecewise graphs. ``"async"``
        loads finish before their request is scheduled, ``"sync"`` ones before the forward
        starts: both are safe under FULL graphs."""
        return str((extra_config or {}).get("load_mode", "async")) == "layer"

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = self.layout
        if layout is None or not (self.load_enabled or self.save_enabled):
            return
        try:
            names = _own_layers(kv_caches, layout, self._kv_cache_config)
            caches = [kv_caches[n] for n in names]
            if layout.kind == "mla":  # vLLM's MLA view is [blocks, 1, block_size, latent]
                caches = [c.squeeze(1) if c.dim() == 4 else c for c in caches]
            layout = self._worker_layout(layout, names, caches)
        except ConfigError as exc:
            log.error("kvpool connector: disabled, every request computes its own KV: %s", exc)
            self.layout = None
            return
        self.layout = layout
        self.namespace = _namespace(self._vllm_config, self.model_id, self.chunk_tokens,
                                    layout, self._tp_rank)
        self.hasher = ChunkHasher(self.namespace)
        self._load_io, self._save_io = _io_threads(caches[0].device)
        # one client for both threads (its calls are serialised): what one learns of a
        # node (down, left behind as hung) the other uses at once
        self._worker_client = self.settings.client()
        try:  # the connector checks the tensors against the layout
            self._loader = self._load_io.submit(self._open, layout, caches).result()
            if layout.kind != "mla" or self._tp_rank == 0:  # MLA: one writer of the latents
                self._saver = self._save_io.submit(self._open, layout, caches).result()
        except (KvpoolError, ValueError) as exc:
            log.error("kvpool connector: disabled, every request computes its own KV: %s", exc)
            self._loader = self._saver = None
            self.layout = None
            return
        staged = sum(p.staging_nbytes for p in (self._loader, self._saver) if p is not None)
        log.info("kvpool connector: %d layers of %s blocks%s, %s chunks of %d tokens (%s, "
                 "model id %r, %s loads) from %s; staging %.1f MiB on %s", len(names),
                 layout.kind, f" ({self._kernel_ratio} kernel blocks a block)"
                 if self._kernel_ratio > 1 else "", layout.chunk_format, self.chunk_tokens,
                 layout.dtype_id, self.model_id, self.settings.load_mode,
                 self.settings.kvpool_url, staged / 2**20, caches[0].device)

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
                layout.dtype_label, self._vllm_config, names))
        return layout

    def get_handshake_metadata(self) -> KvpoolHandshake:
        """This worker's key namespace, for the scheduler (None: disabled)."""
        if self.layout is None or not (self.load_enabled or self.save_enabled):
            return KvpoolHandshake(None)
        return KvpoolHandshake(asdict(self.namespace))

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        """The scheduler hashes with the namespace of the first worker (pipeline stage 0,
        tensor-parallel rank 0), whose chunks its lookups count."""
        first = metadata.get((0, 0))
        if isinstance(first, KvpoolHandshake):
            self.adopt(first)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                                    ) -> None:
        first = metadata.get(0)
        if isinstance(first, KvpoolHandshake):
            self.adopt(first)

    def adopt(self, handshake: KvpoolHandshake) -> None:
        """Scheduler side: hash with the worker's namespace; promise nothing if its
        connector is disabled (each promise would be a failed load)."""
        if handshake.namespace is None:
            if self.load_enabled or self.save_enabled:
                log.error("kvpool connector: the worker's connector is disabled (see its "
                          "log): no loads promised, no saves asked")
            self.load_enabled = self.save_enabled = False
            return
        namespace = Namespace(**handshake.namespace)
        if namespace != self.namespace:
            log.info("kvpool connector: keys of the worker's namespace %s", namespace)
            self.namespace = namespace
            self.hasher = ChunkHasher(namespace)

    @property
    def _kernel_ratio(self) -> int:
        """Kernel blocks a scheduler block holds (vLLM splits blocks for some backends:
        the worker's layout then has the kernel blocks' size)."""
        return self.block_size // self.layout.block_size if self.layout is not None else 1

    def _kernel_ids(self, block_ids: Sequence[int]) -> list[int]:
        """The caches' (kernel) block ids of the scheduler's ``block_ids``."""
        r = self._kernel_ratio
        if r == 1:
            return list(block_ids)
        return [b * r + i for b in block_ids for i in range(r)]

    def _open(self, layout: KVLayout, caches: Sequence[torch.Tensor]) -> PagedKVConnector:
        """On an I/O thread: the connector it drives, over the worker's one client."""
        if hasattr(os, "sched_getaffinity"):  # (on one CPU the client copies on it alone)
            log.info("kvpool connector: %s thread on CPUs %s", threading.current_thread().name,
                     ",".join(map(str, sorted(os.sched_getaffinity(0)))))
        # canonical cpu_attn chunks go through staging (K is transposed on the way, into
        # AMX tiles by vLLM's own op); the engine's own format goes straight between the
        # pool and the blocks
        write: Scatter = VllmCacheWrite(caches) if layout.kind == "cpu_attn_amx" \
            and not layout.engine_format else scatter
        assert self._worker_client is not None
        return PagedKVConnector(self._worker_client, layout, list(caches), self.namespace,
                                staging_slots=self.settings.staging_slots, scatter=write)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvpoolConnectorMetadata) or not meta.loads:
            return
        mode = self.settings.load_mode
        if self._loader is None or self._load_io is None:  # promised: recompute
            if mode == "async":
                for load in meta.loads:
                    self._loading[load.req_id] = _done(self._blocks(load, load.start))
                    self.stats.data["load_errors"] += 1
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

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._finish(pending)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing per layer: a chunk holds every layer, so it is saved in wait_for_save."""

    def wait_for_save(self) -> None:
        """Queue this step's saves on the save thread and return: they read their blocks
        off the step (the scheduler holds a finished request's blocks until
        ``get_finished`` reports its save done)."""
        if self._pending is not None:  # a forward that ran no attention layer
            self.wait_for_layer_load("")
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        valid_until, self._valid_until = self._valid_until, {}
        if not isinstance(meta, KvpoolConnectorMetadata) or not meta.saves:
            return  # (this step's failed loads matter to this step's saves only)
        self._save_owed.update(save.req_id for save in meta.saves)
        if self._saver is None or self._save_io is None:
            return  # owed all the same: reported done when the request finishes
        after = self._engine_event()
        for save in meta.saves:
            tokens = save.tokens
            if save.req_id in valid_until:  # never store blocks a failed load left empty
                tokens = tokens[: valid_until[save.req_id] // self.chunk_tokens
                                * self.chunk_tokens]
            chunks = len(tokens) // self.chunk_tokens
            if not chunks:
                continue
            with self._lock:
                if self._queued_chunks + chunks > self.settings.save_queue_chunks:
                    self.stats.data["saves_skipped"] += 1
                    self._once("queue", "the pool is behind on saves (%d chunks queued): "
                               "saves are skipped until it catches up", self._queued_chunks)
                    continue
                self._queued_chunks += chunks
            self._saving[save.req_id] = self._save_io.submit(
                self._save_one, tokens, save.block_ids, chunks, after)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """A preempted request's blocks are freed and may be written this step: its save,
        if still queued or running, finishes first."""
        flush = getattr(kv_connector_metadata, "flush", None) or ()
        for req_id in flush:
            saving = self._saving.get(req_id)
            if saving is not None:
                saving.result()  # _save_one never raises

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose blocks the scheduler held for a save, now saved; requests
        whose async load is done, loaded or not: failed blocks are reported by
        ``get_block_ids_with_load_errors`` in the same step)."""
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
            self._engine_waits(self._loader)
        owed = finished_req_ids & self._save_owed
        self._save_owed -= owed
        self._finishing |= owed
        sending = set()
        for req_id, saving in list(self._saving.items()):
            if saving.done():
                del self._saving[req_id]
        for req_id in list(self._finishing):
            if req_id not in self._saving:
                self._finishing.discard(req_id)
                sending.add(req_id)
        return sending or None, recving or None

    def _engine_event(self) -> Any:
        """On CUDA, an event recorded on the engine's stream (on the engine's thread): an
        I/O thread waits for it before it writes a block that the engine's queued
        kernels may still read, or reads blocks its forward is still writing. No host
        sync on the engine's thread."""
        paged = self._loader or self._saver
        if paged is None or paged.device.type != "cuda":
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(paged.device))
        return event

    def _engine_waits(self, paged: PagedKVConnector | None) -> None:
        """On CUDA, the engine's stream waits (on the device) for the loads queued on the
        loader's side stream."""
        if paged is not None and paged.stream is not None:
            torch.cuda.current_stream(paged.device).wait_stream(paged.stream)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            failed, self._load_errors = self._load_errors, set()
        return failed

    def get_kv_connector_stats(self) -> KvpoolConnectorStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, KvpoolConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KvpoolConnectorStats | None:
        return KvpoolConnectorStats(data=dict(data)) if data is not None \
            else KvpoolConnectorStats()

    def shutdown(self) -> None:
        for io, paged in ((self._load_io, self._loader), (self._save_io, self._saver)):
            if io is not None:
                if paged is not None:  # after what is queued (saves finish first)
                    io.submit(paged.close).result()
                io.shutdown(wait=True)
        for client in (self._client, self._worker_client):
            if client is not None:
                client.close()

    # -- on the I/O threads -----------------------------------------------------------------

    def _finish(self, pending: Future[set[int]]) -> None:
        failed = pending.result()  # _load_all never raises
        self._engine_waits(self._loader)
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
        b = self.block_size
        return set(load.block_ids[max(loaded, load.start) // b : load.end // b])

    def _load_one(self, load: _Load, after: Any) -> set[int]:
        """Load one request's chunks; the blocks promised and not loaded (never raises)."""
        return self._load(load, after)[1]

    def _load(self, load: _Load, after: Any) -> tuple[int, set[int]]:
        assert self._loader is not None
        if after is not None:
            after.synchronize()  # the engine's queued kernels are done with these blocks
        started = time.perf_counter()
        loaded = 0
        if not self.backoff.allow():  # promised before the pool failed: recompute
            self.stats.data["backed_off"] += 1
        else:
            try:
                loaded = self._loader.load(load.tokens, self._kernel_ids(load.block_ids),
                                           max_tokens=load.end, skip_tokens=load.start)
                self.backoff.succeeded()
            except Exception as exc:  # never into the engine: the blocks are recomputed
                self._once("load", "a load failed, its tokens are recomputed: %s", exc)
                if isinstance(exc, KvpoolError):
                    self._failed("load")
        self.stats.data["load_s"] += time.perf_counter() - started
        self.stats.data["tokens_loaded"] += max(0, min(loaded, load.end) - load.start)
        if loaded >= load.end:
            return loaded, set()
        self.stats.data["load_errors"] += 1
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

    def _save_one(self, tokens: list[int], block_ids: list[int], chunks: int,
                  after: Any) -> None:
        """Store one request's full chunks (those the pool lacks); never raises."""
        assert self._saver is not None
        try:
            if after is not None:
                after.synchronize()  # the forward that wrote these blocks is done
            if not self.backoff.allow():
                self.stats.data["backed_off"] += 1
                return
            started = time.perf_counter()
            try:
                self.stats.data["tokens_stored"] += self._saver.store(
                    tokens, self._kernel_ids(block_ids))
                self.backoff.succeeded()
            except Exception as exc:  # a cache that missed a save is only a colder cache
                self.stats.data["save_errors"] += 1
                self._once("save", "a save failed (the pool just misses it): %s", exc)
                if isinstance(exc, KvpoolError):
                    self._failed("save")
            self.stats.data["save_s"] += time.perf_counter() - started
        finally:
            with self._lock:
                self._queued_chunks -= chunks


def _io_threads(device: torch.device) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
    """The load thread and the save thread, each on ``device`` where it is a GPU (with
    every GPU visible, a thread that never set it would allocate and make its streams on
    GPU 0, not on its tensor-parallel rank's)."""
    init = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
    return (ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-load",
                               initializer=init),
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-save",
                               initializer=init))


def _done(result: set[int]) -> Future[set[int]]:
    """A future already holding ``result``."""
    future: Future[set[int]] = Future()
    future.set_result(result)
    return future


def _tp_rank(vllm_config: Any) -> int:
    """This process's tensor-parallel rank (0 in the scheduler, which has no TP group: it
    looks up rank 0's keys)."""
    if vllm_config.parallel_config.tensor_parallel_size <= 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


def _tp_of(layout: KVLayout, vllm_config: Any, rank: int) -> tuple[int, int]:
    """The namespace's (tp_size, tp_rank): an MLA latent is the same on every rank (one
    chunk serves them all), the heads of other layouts are the rank's own."""
    if layout.kind == "mla":
        return 1, 0
    return int(vllm_config.parallel_config.tensor_parallel_size), rank


def _namespace(vllm_config: Any, model_id: str, chunk_tokens: int, layout: KVLayout | None,
               rank: int) -> Namespace:
    """The key namespace of this engine's KV as its config says it (the worker's, once it
    has seen its caches, is final: see ``register_kv_caches``)."""
    if layout is not None:
        size, rank = _tp_of(layout, vllm_config, rank)
        return layout.namespace(model_id, chunk_tokens=chunk_tokens, tp_size=size,
                                tp_rank=rank)
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    return Namespace(model=model_id, dtype=dtype_name(model.dtype),  # (idle: never used)
                     num_layers=model.get_num_layers(parallel),
                     num_kv_heads=model.get_num_kv_heads(parallel),
                     head_dim=model.get_head_size(), chunk_tokens=chunk_tokens,
                     tp_size=parallel.tensor_parallel_size, tp_rank=rank)


def _own_layers(kv_caches: dict[str, torch.Tensor], layout: KVLayout,
                kv_cache_config: Any = None) -> list[str]:
    """The names of the caches that hold this model's own attention layers, in layer
    order: those of vLLM's KV cache group (one group of full attention or MLA; hybrid
    models are not mapped), of the layers this pipeline stage runs (a draft model's
    layers come after the target's), one name per cache (layers that share another's
    KV cache point at the same tensor)."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    names = list(kv_caches)
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if groups:
        attention = [g for g in groups
                     if isinstance(g.kv_cache_spec, (FullAttentionSpec, MLAAttentionSpec))]
        if len(attention) != 1 or len(groups) != 1:
            kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
            raise ConfigError(f"kvpool connector: vLLM's KV cache has groups {kinds}; "
                              "one group of full attention or MLA is mapped")
        grouped = set(attention[0].layer_names)
        names = [n for n in names if n in grouped]
    # a draft model's layers (EAGLE, MTP) are registered beside the target's, numbered
    # after them
    start, end = layout.layer_range or (0, layout.num_layers)
    own: list[str] = []
    seen: set[tuple[int, int]] = set()
    for name in sorted(names, key=extract_layer_index):
        index = extract_layer_index(name)
        if not start <= index < end:
            continue
        cache = kv_caches[name]
        where = (int(cache.data_ptr()), int(cache.storage_offset()))
        if where in seen:  # a layer reading another layer's KV: stored once
            continue
        seen.add(where)
        own.append(name)
    return own


def _scaled_label(label: str, vllm_config: Any, names: Sequence[str]) -> str:
    """A quantized cache's namespace dtype: its format, and a digest of the layers' K and
    V scales (vLLM loads them from the checkpoint; 1.0 where it has none) unless they are
    all 1. Chunks written with other scales are other bytes for the same values."""
    layers = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    scales = []
    for name in names:
        layer = layers.get(name)
        scales.append((float(getattr(layer, "_k_scale_float", 1.0)),
                       float(getattr(layer, "_v_scale_float", 1.0))))
    if all(k == 1.0 and v == 1.0 for k, v in scales):
        return label
    digest = xxhash.xxh3_64_hexdigest(repr(scales).encode())
    return f"{label}-s{digest[:12]}"


class VllmCacheWrite:
    """Canonical chunks into ``cpu_attn_amx`` blocks (``isa="amx"``) or ``cpu_attn`` ones
    (``"vec"``) through vLLM's own cache-write op (``cpu_attn_reshape_and_cache``, the op
    the engine writes its KV with), a :class:`~kvpool.gpu.paged.Scatter` for ``caches``
    (the layers' tensors, in order).

    Equal to :func:`kvpool.gpu.paged.scatter` bit for bit (tests/vllm_driver.py checks
    both against the op), and faster into AMX tiles: 3.5-3.65 GB/s against 1.4-1.6 on
    one thread (16 chunks of 256 tokens, SmolLM2's geometry, 2-core VM), so the connector
    writes AMX blocks with it. Into ``vec`` blocks the op is no faster than kvpool's copy
    (2.65 against 2.8 GB/s then; ``python -m bench.vllm --load-path`` measures both), so
    those keep kvpool's copy and the benchmark runs the op as the engine's own floor.
    """

    def __init__(self, caches: Sequence[torch.Tensor], isa: str = "amx") -> None:
        from vllm import _custom_ops as ops

        self._op = ops.cpu_attn_reshape_and_cache
        self._isa = isa
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        for cache in caches:  # [N, H, B, 2D] as the backend views it: K rows, then V rows
            n, h, b, d2 = cache.shape
            k, v = cache.view(n, h, 2 * b, d2 // 2).chunk(2, dim=2)
            self._kv.append((k, v))

    def __call__(self, layout: KVLayout, caches: Sequence[torch.Tensor], ids: torch.Tensor,
                 chunk: torch.Tensor, *, first_block: int = 0) -> None:
        b = layout.block_size
        offsets = torch.arange(b, dtype=torch.int64)
        slots = (ids.to(torch.int64).view(-1, 1) * b + offsets).view(-1)
        start = first_block * b
        for layer, (k, v) in enumerate(self._kv):
            self._op(chunk[layer, 0, start:], chunk[layer, 1, start:], k, v, slots, self._isa)


def _layout_kind(vllm_config: Any, on_cpu: bool) -> LayoutKind:
    """The layout kind of this engine's blocks: ``bhnc`` (vLLM's standardized views, every
    backend off the CPU), ``cpu_attn`` or ``cpu_attn_amx``; ConfigError unless its
    attention backend stores blocks this module maps. ``on_cpu``: vLLM's platform is its
    CPU build (``current_platform.is_cpu()``)."""
    model = vllm_config.model_config
    block_size = int(vllm_config.cache_config.block_size)
    head_dim = model.get_head_size()
    if getattr(model, "use_mla", False):
        if on_cpu:
            raise ConfigError("kvpool connector: vLLM's CPU MLA backend turns prefix caching "
                              "and chunked prefill off, so it cannot attend to a prefix it "
                              "did not compute in the same step")
        return "mla"  # [blocks, 1, block_size, latent] views: one latent vector a token
    if not on_cpu:  # a backend whose content differs (padded, K/V of other sizes) fails
        return "bhnc"  # the shape check in register_kv_caches, and the connector idles
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        isa = _get_attn_isa(model.dtype, block_size, head_dim,
                            str(vllm_config.cache_config.cache_dtype))
    except NotImplementedError as exc:  # vLLM itself will say so at start
        raise ConfigError(f"kvpool connector: vLLM's CPU attention: {exc}") from exc
    if isa == "amx":
        return "cpu_attn_amx"
    if isa not in ("vec", "vec16"):
        raise ConfigError(f"kvpool connector: the CPU attention kernels here are {isa!r}, "
                          "whose packed blocks are not mapped (vec, vec16 and amx are)")
    return "cpu_attn"


def _layout(vllm_config: Any, chunk_format: str, on_cpu: bool | None = None) -> KVLayout:
    """The paged layout of this engine's caches, from its attention backend and model
    config; ConfigError (LayoutError) if it is not one this module maps. ``on_cpu``:
    vLLM's platform is its CPU build (default: ask vLLM)."""
    from vllm.platforms import current_platform

    model, parallel, cache = (vllm_config.model_config, vllm_config.parallel_config,
                              vllm_config.cache_config)
    if on_cpu is None:
        on_cpu = bool(current_platform.is_cpu())
    dtype, label = _cache_dtype(vllm_config, on_cpu)
    kind = _layout_kind(vllm_config, on_cpu)
    stage = None  # a pipeline stage holds its own layers: their range is in the namespace
    if parallel.pipeline_parallel_size > 1:
        stage = tuple(model.get_layers_start_end_indices(parallel))
    return KVLayout(model.get_num_layers(parallel),
                    1 if kind == "mla" else model.get_num_kv_heads(parallel),
                    model.get_head_size(), dtype, int(cache.block_size), kind=kind,
                    chunk_format="engine" if chunk_format == "engine" else "canonical",
                    layer_range=stage, dtype_label=label)


def _cache_dtype(vllm_config: Any, on_cpu: bool) -> tuple[torch.dtype, str | None]:
    """The KV cache tensors' dtype, and the namespace's name for a quantized cache's
    elements (fp8: ``uint8`` tensors; the label gets its scales in the worker)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    name = str(cache.cache_dtype or "auto")
    if name == "auto" or name == dtype_name(model.dtype):
        return model.dtype, None
    if name not in _FP8:
        raise ConfigError(f"kvpool connector: KV cache dtype {name} is not mapped (fp8, "
                          "fp8_e4m3 and fp8_e5m2 are: one scale a layer for K and one for "
                          "V); use one of those or the model's dtype")
    if on_cpu:
        raise ConfigError("kvpool connector: vLLM's CPU fp8 KV cache is not mapped (its "
                          "packed blocks need AVX-512 or AMX and were never checked against "
                          "vLLM's op); use the model's dtype")
    if name == "fp8":  # vLLM's "fp8" is e4m3 (its fnuz variant on the ROCm GPUs using it)
        from vllm.platforms import current_platform

        name = "fp8_e4m3fnuz" if current_platform.is_fp8_fnuz() else "fp8_e4m3"
    return torch.uint8, name
