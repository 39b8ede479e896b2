"""Gather a chunk's blocks out of an engine's paged KV tensors, and scatter them back.

Both work on preallocated buffers (``out=`` / in place) where the layout
allows, so the hot path allocates no tensor memory: ``chunk`` is a dense view
of a staging slot shaped ``layout.chunk_shape(chunk_tokens)``, ``ids`` the
chunk's block ids (a long tensor on the caches' device, ``chunk_tokens //
block_size`` of them). ``cpu_attn`` blocks hold K transposed (``cpu_attn_amx``
blocks hold K and V in AMX tiles): their gather and scatter copy through strided
views, all of a chunk's in one call. ``bhnc`` views (vLLM's GPU backends) hold a
block's heads before its tokens, and a token's K and V side by side: one strided copy
a layer each way, through the engine's own strides.

Chunks in the engine's own format (``layout.engine_format``) are the blocks'
bytes, layer by layer: gather and scatter are one ``index_select`` /
``index_copy_`` a layer, no conversion.

``scatter(..., first_block=f)`` writes only the chunk's blocks ``f`` and
later into ``ids`` (which then names just those): an engine that already
holds the first blocks of a chunk (its own prefix cache) loads the rest
without touching blocks other requests may be reading.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvpool.gpu.layout import CPU_ATTN_KINDS, KVLayout

__all__ = ["CpuAttnScatter", "Scatter", "gather", "gather_scratch_shape", "scatter", "scatter_for"]


class Scatter(Protocol):
    """What writes a chunk into an engine's blocks: :func:`scatter`, or an engine's own
    op with the same effect bit for bit (vLLM's AMX cache write, ``gpu/vllm.py``)."""

    def __call__(self, layout: KVLayout, caches: Sequence[torch.Tensor], ids: torch.Tensor,
                 chunk: torch.Tensor, *, first_block: int = 0) -> None: ...


def _split(layout: KVLayout, chunk: torch.Tensor, layer: int,
           first_block: int = 0) -> list[torch.Tensor]:
    """Layer ``layer`` of ``chunk`` from block ``first_block`` on, as dense views:
    ``[K, V]`` each [nb, B, H, D], or ``[latent]`` [nb, B, D] (MLA)."""
    b = layout.block_size
    start = first_block * b
    if layout.kind == "mla":
        part = chunk[layer][start:]
        return [part.view(-1, b, layout.head_dim)]
    return [chunk[layer][kv, start:].view(-1, b, layout.num_kv_heads, layout.head_dim)
            for kv in (0, 1)]


def gather_scratch_shape(layout: KVLayout, chunk_tokens: int) -> tuple[int, ...]:
    """The shape of the ``scratch`` :func:`gather` reads a ``bhnc`` layer's blocks into
    (one layer of one chunk: ``[blocks, H, N, 2, D]``)."""
    b = layout.block_size
    return (chunk_tokens // b, layout.num_kv_heads, b, 2, layout.head_dim)


def gather(layout: KVLayout, caches: Sequence[torch.Tensor], ids: torch.Tensor,
           chunk: torch.Tensor, *, scratch: torch.Tensor | None = None) -> None:
    """Copy the blocks ``ids`` of every layer into ``chunk`` (the chunk payload layout).
    ``scratch`` (``bhnc``; shaped by :func:`gather_scratch_shape`, on the caches'
    device): reused for each layer's blocks, so the gather allocates nothing (without
    it, each layer's blocks go through a temporary)."""
    if layout.engine_format:
        for layer, cache in enumerate(caches):
            torch.index_select(cache, 0, ids, out=chunk[layer])
        return
    if layout.kind in CPU_ATTN_KINDS:
        _gather_cpu_attn(layout, caches, ids, chunk)
        return
    if layout.kind == "bhnc":
        n = len(ids)
        for layer, cache in enumerate(caches):
            if scratch is not None:
                blocks = torch.index_select(_bhnc_kv(layout, cache), 0, ids, out=scratch[:n])
            else:
                blocks = torch.index_select(_bhnc_kv(layout, cache), 0, ids)
            _chunk_bhnc(layout, chunk, layer, 0).copy_(blocks)
        return
    for layer, cache in enumerate(caches):
        dst = _split(layout, chunk, layer)
        if layout.kind == "flash":
            for kv in (0, 1):
                torch.index_select(cache[kv], 0, ids, out=dst[kv])
        elif layout.kind == "blocks_first":
            for kv in (0, 1):  # cache[:, kv] is a strided [num_blocks, B, H, D] view
                torch.index_select(cache[:, kv], 0, ids, out=dst[kv])
        else:
            torch.index_select(cache, 0, ids, out=dst[0])


def scatter(layout: KVLayout, caches: Sequence[torch.Tensor], ids: torch.Tensor,
            chunk: torch.Tensor, *, first_block: int = 0) -> None:
    """Copy ``chunk`` (from its block ``first_block`` on) into the blocks ``ids`` of every
    layer (the inverse of :func:`gather`)."""
    if layout.engine_format:
        for layer, cache in enumerate(caches):
            cache.index_copy_(0, ids, chunk[layer][first_block:])
        return
    if layout.kind in CPU_ATTN_KINDS:
        _scatter_cpu_attn(layout, caches, ids, chunk, first_block)
        return
    if layout.kind == "bhnc":
        for layer, cache in enumerate(caches):
            _bhnc_kv(layout, cache).index_copy_(0, ids, _chunk_bhnc(layout, chunk, layer,
                                                                    first_block))
        return
    for layer, cache in enumerate(caches):
        src = _split(layout, chunk, layer, first_block)
        if layout.kind == "flash":
            for kv in (0, 1):
                cache[kv].index_copy_(0, ids, src[kv])
        elif layout.kind == "blocks_first":
            for kv in (0, 1):
                cache[:, kv].index_copy_(0, ids, src[kv])
        else:
            cache.index_copy_(0, ids, src[0])


def _bhnc_kv(layout: KVLayout, cache: torch.Tensor) -> torch.Tensor:
    """A ``bhnc`` layer as ``[num_blocks, H, N, 2, D]`` (K=0, V=1): a view through the
    engine's strides (splitting a dimension never copies)."""
    return cache.view(*cache.shape[:3], 2, layout.head_dim)


def _chunk_bhnc(layout: KVLayout, chunk: torch.Tensor, layer: int, first_block: int
                ) -> torch.Tensor:
    """Layer ``layer`` of ``chunk`` from block ``first_block`` on, in the order of
    :func:`_bhnc_kv`'s view: ``[nb, H, N, 2, D]`` over the chunk's ``[2, T, H, D]``."""
    b, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
    part = chunk[layer][:, first_block * b :]
    return part.view(2, -1, b, h, d).permute(1, 3, 2, 0, 4)


# cpu_attn scatter (the load path): K and V go straight from the chunk into each layer's
# blocks, through strided views, in one torch._foreach_copy_ per chunk (its per-view loop
# runs in C++). Measured on 16 chunks of 256 tokens (SmolLM2: 30 layers, 3 heads, dim 64,
# block 128; 94 MB), paired runs on a loaded 2-core VM: 24-28 ms, against 30-33 ms through
# one temporary of every layer's blocks (transposes for all layers at once, then an
# index_copy_ per layer), ~3x that one layer at a time, and 42 ms as two-pass 2D transposes.


def _packed_shapes(layout: KVLayout) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """How one (block, head) of a cpu_attn kind holds K and V: their shapes in the block
    (see gpu/layout.py), K in :func:`_k_units`; read by :func:`_cpu_attn_blocks` only."""
    b, d = layout.block_size, layout.head_dim
    if layout.kind == "cpu_attn_amx":  # AMX tiles: K [b/16, d/2, 16, 2], V [d/16, b/2, 16, 2]
        return (b // 16, d // 2, 16), (d // 16, b // 2, 16, 2)
    return (d, b), (b, d)  # vec: K column-major, V row-major


def _k_units(layout: KVLayout, t: torch.Tensor) -> torch.Tensor:
    """``t`` (K elements, its last dimension dense) in the units K is packed in: for AMX
    the pairs of dims that stay together, as int32 (bf16 only), which copies 3.4x faster
    than moving 2-byte elements (3.8 against 1.1 GB/s on SmolLM2's geometry)."""
    return t.view(torch.int32) if layout.kind == "cpu_attn_amx" else t


def _cpu_attn_blocks(layout: KVLayout, cache: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block of one layer's cache as (K, V) views ``[num_blocks, H, *packed]``: per
    (block, head) K comes first, then V, each packed as :func:`_packed_shapes` says."""
    n, h = cache.shape[0], layout.num_kv_heads
    b, d = layout.block_size, layout.head_dim
    k_shape, v_shape = _packed_shapes(layout)
    flat = cache.view(n, h, 2 * b * d)
    return (_k_units(layout, flat[..., : b * d]).view(n, h, *k_shape),
            flat[..., b * d :].view(n, h, *v_shape))


def _chunk_kv(layout: KVLayout, chunk: torch.Tensor, first_block: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's K and V from block ``first_block`` on, as views in the blocks' order:
    ``[L, nb, H, *packed]`` (vec: K ``[.., D, B]``, V ``[.., B, D]``)."""
    n_layers, _, tokens = chunk.shape[:3]
    b, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
    nb = tokens // b - first_block
    part = chunk[:, :, first_block * b :]
    if layout.kind == "cpu_attn_amx":
        # K in dim pairs [t//16, t%16, h, d//2] -> [h, t//16, d//2, t%16]
        k = _k_units(layout, part[:, 0]).view(n_layers, nb, b // 16, 16, h, d // 2)
        k = k.permute(0, 1, 4, 2, 5, 3)
        # V [t//2, t%2, h, d//16, d%16] -> [h, d//16, t//2, d%16, t%2]
        v = part[:, 1].view(n_layers, nb, b // 2, 2, h, d // 16, 16)
        v = v.permute(0, 1, 4, 5, 2, 6, 3)
        return k, v
    k = part[:, 0].view(n_layers, nb, b, h, d).permute(0, 1, 3, 4, 2)
    v = part[:, 1].view(n_layers, nb, b, h, d).permute(0, 1, 3, 2, 4)
    return k, v


def _block_views(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], block: int
                 ) -> list[torch.Tensor]:
    """Block ``block`` of every layer, K then V a layer, of ``layers`` (each layer's
    blocks as :func:`_cpu_attn_blocks` views them)."""
    return [t for k, v in layers for t in (k[block], v[block])]


def _chunk_views(layout: KVLayout, chunk: torch.Tensor, first_block: int
                 ) -> list[torch.Tensor]:
    """The chunk's blocks from ``first_block`` on as :func:`_block_views` lists them,
    block after block: a few unbinds (each one call for all its views), not a call a
    view. On a CPU engine's load thread every call is a hand-over of the GIL with the
    engine's thread, which waits at each one (``bench.gil_loader``)."""
    chunk_k, chunk_v = _chunk_kv(layout, chunk, first_block)  # [L, nb, H, *packed]
    views: list[torch.Tensor] = []
    for k, v in zip(chunk_k.transpose(0, 1).unbind(0), chunk_v.transpose(0, 1).unbind(0),
                    strict=True):  # one block of every layer
        views += [t for pair in zip(k.unbind(0), v.unbind(0), strict=True) for t in pair]
    return views


def _gather_cpu_attn(layout: KVLayout, caches: Sequence[torch.Tensor], ids: torch.Tensor,
                     chunk: torch.Tensor) -> None:
    # the other way round, strided writes into the chunk measured slower (26-27 ms against
    # 22-24): the blocks are copied out into one temporary, transposed for every layer at
    # once into the chunk, which the copy then writes in order
    first, n_layers, nb = caches[0], len(caches), len(ids)
    blocks = torch.empty((n_layers * nb, *first.shape[1:]), dtype=first.dtype,
                         device=first.device)
    for layer, cache in enumerate(caches):
        torch.index_select(cache, 0, ids, out=blocks[layer * nb:(layer + 1) * nb])
    k, v = _cpu_attn_blocks(layout, blocks)  # [layers * nb, H, *packed]
    chunk_k, chunk_v = _chunk_kv(layout, chunk, 0)
    chunk_k.copy_(k.view(n_layers, nb, *k.shape[1:]))
    chunk_v.copy_(v.view(n_layers, nb, *v.shape[1:]))


def _scatter_cpu_attn(layout: KVLayout, caches: Sequence[torch.Tensor], ids: torch.Tensor,
                      chunk: torch.Tensor, first_block: int) -> None:
    layers = [_cpu_attn_blocks(layout, cache) for cache in caches]
    torch._foreach_copy_([view for block in ids.tolist() for view in _block_views(layers, block)],
                         _chunk_views(layout, chunk, first_block))


class CpuAttnScatter:
    """:func:`scatter` into the ``cpu_attn`` kinds' blocks of ``caches``, one
    ``torch._foreach_copy_`` a chunk (its per-view loop runs in C++):

    - canonical chunks, with each block's K and V views of every layer made at its first
      write and kept (~1.3 KB a block and layer: 2 views of ~630 bytes), the chunk's in a
      few unbinds: a few torch calls a chunk, not 4 a block and layer. On a CPU engine's
      load thread each call is a hand-over of the GIL with the engine's thread, whose
      forward waits at each one: an engine-like step beside chunk writes in a thread
      (``bench.gil_loader``, 256-token chunks of SmolLM2's geometry into vec blocks) took
      1.18-1.20x its time alone, against 1.33-1.41x with every view made at each call,
      and the writes ran at 3.3-3.4 GB/s against 2.9-3.1;
    - chunks in the engine's format, block by block (an ``index_copy_`` a layer, as
      :func:`scatter` does, copied the same 32 chunks at 2.5 GB/s against 6.3 on a
      2-core AMD EPYC: ~30 op dispatches a chunk for one block each).

    Another layout or other caches than its own go to :func:`scatter`."""

    def __init__(self, layout: KVLayout, caches: Sequence[torch.Tensor]) -> None:
        self._layout = layout
        self._caches = list(caches)
        self._views = [_cpu_attn_blocks(layout, cache) for cache in caches] \
            if layout.kind in CPU_ATTN_KINDS and not layout.engine_format else []
        #: each block's views (:func:`_block_views`), from its first write on
        self._blocks: list[list[torch.Tensor] | None] = \
            [None] * (layout.num_blocks_of(self._caches[0]) if self._views else 0)

    def __call__(self, layout: KVLayout, caches: Sequence[torch.Tensor], ids: torch.Tensor,
                 chunk: torch.Tensor, *, first_block: int = 0) -> None:
        if layout.kind not in CPU_ATTN_KINDS or layout != self._layout \
                or len(caches) != len(self._caches) \
                or any(a is not b for a, b in zip(caches, self._caches, strict=True)):
            scatter(layout, caches, ids, chunk, first_block=first_block)
            return
        if layout.engine_format:
            blocks = ids.tolist()
            part = chunk[:, first_block:first_block + len(blocks)]  # [L, nb, *block]
            sources = list(part.flatten(0, 1).unbind(0)) if part.is_contiguous() else \
                [block for layer in part.unbind(0) for block in layer.unbind(0)]
            torch._foreach_copy_([cache[block] for cache in caches for block in blocks],
                                 sources)
            return
        torch._foreach_copy_([view for block in ids.tolist() for view in self._views_of(block)],
                             _chunk_views(layout, chunk, first_block))

    def _views_of(self, block: int) -> list[torch.Tensor]:
        views = self._blocks[block]
        if views is None:
            views = self._blocks[block] = _block_views(self._views, block)
        return views


def scatter_for(layout: KVLayout, caches: Sequence[torch.Tensor], chosen: Scatter) -> Scatter:
    """``chosen``; for :func:`scatter` into ``cpu_attn`` kinds' blocks, a
    :class:`CpuAttnScatter` of ``caches`` (the same bytes, sooner)."""
    if chosen is scatter and layout.kind in CPU_ATTN_KINDS:
        return CpuAttnScatter(layout, caches)
    return chosen
