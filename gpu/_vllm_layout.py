"""What vLLM's config and its registered caches say of this engine's KV: the paged layout
(attention backend, dtype, quantization, pipeline stage), the key namespace, the caches
of this model's own layers, and vLLM's own cache-write op for canonical chunks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from kvpool.gpu.layout import KVLayout, LayoutKind, dtype_name
from kvpool.placement.keys import Namespace
from kvpool.protocol.errors import ConfigError

__all__ = ["VllmCacheWrite"]

#: quantized KV caches served: one byte an element with one scale per layer for K and one
#: for V (per-token or per-block scales live beside the blocks: not mapped)
_FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")


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
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C's CPU ops)

        # the op itself, not vLLM's Python wrapper of it: on the load thread every torch
        # call is a hand-over of the GIL with the engine's thread, whose forward waits at
        # each one (below: a few calls a chunk, then one a layer)
        self._op = torch.ops._C.cpu_attn_reshape_and_cache
        self._isa = isa
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        for cache in caches:  # [N, H, B, 2D] as the backend views it: K rows, then V rows
            n, h, b, d2 = cache.shape
            k, v = cache.view(n, h, 2 * b, d2 // 2).chunk(2, dim=2)
            self._kv.append((k, v))
        #: tokens a block of the caches holds, and their offsets in it
        self._block = int(caches[0].shape[2]) if caches else 0
        self._offsets = torch.arange(self._block, dtype=torch.int64)

    def __call__(self, layout: KVLayout, caches: Sequence[torch.Tensor], ids: torch.Tensor,
                 chunk: torch.Tensor, *, first_block: int = 0) -> None:
        b = layout.block_size
        if b != self._block:  # (slots from the layout's blocks into the caches' offsets)
            raise ConfigError(f"kvpool connector: the layout's blocks hold {b} tokens, "
                              f"vLLM's caches' {self._block}")
        slots = (ids.to(torch.int64).view(-1, 1) * b + self._offsets).view(-1)
        # every layer's K and V planes ([T, H, D] views) in one call: K of layer l at 2l
        planes = chunk[:, :, first_block * b:].flatten(0, 1).unbind(0)
        op, isa = self._op, self._isa
        for layer, (k, v) in enumerate(self._kv):
            op(planes[2 * layer], planes[2 * layer + 1], k, v, slots, isa, 1.0, 1.0, "auto")


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
