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

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
)

from kvpool.gpu._vllm_layout import VllmCacheWrite
from kvpool.gpu._vllm_scheduler import SchedulerSide
from kvpool.gpu._vllm_state import (
    ConnectorState,
    KvpoolConnectorMetadata,
    KvpoolConnectorStats,
    KvpoolHandshake,
    KvpoolSettings,
    _log_where_vllm_logs,
    default_model_id,
)
from kvpool.gpu._vllm_worker import WorkerSide
from kvpool.gpu.backoff import Backoff

__all__ = ["VllmCacheWrite", "Backoff", "KvpoolConnector", "KvpoolConnectorMetadata",
           "KvpoolConnectorStats", "KvpoolHandshake", "KvpoolSettings", "default_model_id"]


class KvpoolConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """kvpool behind vLLM's V1 KV connector interface (see the module doc): vLLM's calls,
    each handed to the side that answers it (:class:`SchedulerSide` in the scheduler's
    process, :class:`WorkerSide` in a worker's) over one :class:`ConnectorState`."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_where_vllm_logs()
        self.state = ConnectorState(vllm_config, self._kv_transfer_config)
        self.scheduler_side = SchedulerSide(self.state)
        self.worker_side = WorkerSide(self.state, kv_cache_config)

    # -- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self.scheduler_side.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvpoolConnectorMetadata:
        return self.scheduler_side.step(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            self.scheduler_side.failed_blocks(invalid)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.finished(request.request_id), None

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        """The scheduler hashes with the namespace of the first worker (pipeline stage 0,
        tensor-parallel rank 0), whose chunks its lookups count."""
        first = metadata.get((0, 0))
        if isinstance(first, KvpoolHandshake):
            self.scheduler_side.adopt(first)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                                    ) -> None:
        first = metadata.get(0)
        if isinstance(first, KvpoolHandshake):
            self.scheduler_side.adopt(first)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """``load_mode="layer"`` waits for its load in ``wait_for_layer_load``, which a
        FULL CUDA-graph replay never runs: vLLM then uses piecewise graphs. ``"async"``
        loads finish before their request is scheduled, ``"sync"`` ones before the forward
        starts: both are safe under FULL graphs."""
        return str((extra_config or {}).get("load_mode", "async")) == "layer"

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register(kv_caches)

    def get_handshake_metadata(self) -> KvpoolHandshake:
        return self.worker_side.handshake()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker_side.start_load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_side.wait_for_layer_load()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing per layer: a chunk holds every layer, so it is saved in wait_for_save."""

    def wait_for_save(self) -> None:
        """Queue this step's saves on the save thread and return: they read their blocks
        off the step (the scheduler holds a finished request's blocks until
        ``get_finished`` reports its save done)."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        self.worker_side.queue_saves(meta)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """A preempted request's blocks are freed and may be written this step: its save,
        if still queued or running, finishes first."""
        self.worker_side.saves.flush(getattr(kv_connector_metadata, "flush", None) or ())

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.load_errors()

    def get_kv_connector_stats(self) -> KvpoolConnectorStats | None:
        return self.state.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KvpoolConnectorStats | None:
        return KvpoolConnectorStats(data=dict(data)) if data is not None \
            else KvpoolConnectorStats()

    def shutdown(self) -> None:
        self.worker_side.shutdown()
        self.scheduler_side.close()
