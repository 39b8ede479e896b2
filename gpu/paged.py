"""Gather a chunk's blocks out of an engine's paged KV tensors, and scatter them back.

Both work on preallocated buffers (``out=`` / in place) where the layout
allows, so the hot path allocates no tensor memory: ``chunk`` is a dense view
of a staging slot shaped ``layout.chunk_shape(chunk_tokens)``, ``ids`` the
chunk's block ids (a long tensor on the caches' device, ``chunk_tokens //
block_size`` of them). ``cpu_attn`` blocks hold K transposed, so its gather
and scatter go through one temporary of the selected blocks per layer.

``scatter(..., first_block=f)`` writes only the chunk's blocks ``f`` and
later into ``ids`` (which then names just those): an engine that already
holds the first blocks of a chunk (its own prefix cache) loads the rest
without touching blocks other requests may be reading.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.gpu.layout import KVLayout

__all__ = ["gather", "scatter"]


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


def gather(layout: KVLayout, caches: Sequence[torch.Tensor], ids: torch.Tensor,
           chunk: torch.Tensor) -> None:
    """Copy the blocks ``ids`` of every layer into ``chunk`` (the chunk payload layout)."""
    for layer, cache in enumerate(caches):
        dst = _split(layout, chunk, layer)
        if layout.kind == "flash":
            for kv in (0, 1):
                torch.index_select(cache[kv], 0, ids, out=dst[kv])
        elif layout.kind == "blocks_first":
            for kv in (0, 1):  # cache[:, kv] is a strided [num_blocks, B, H, D] view
                torch.index_select(cache[:, kv], 0, ids, out=dst[kv])
        elif layout.kind == "cpu_attn":
            k, v = _cpu_attn_halves(layout, cache.index_select(0, ids))
            dst[0].copy_(k.permute(0, 3, 1, 2))  # [nb, H, D, B] -> [nb, B, H, D]
            dst[1].copy_(v.permute(0, 2, 1, 3))  # [nb, H, B, D] -> [nb, B, H, D]
        else:
            torch.index_select(cache, 0, ids, out=dst[0])


def scatter(layout: KVLayout, caches: Sequence[torch.Tensor], ids: torch.Tensor,
            chunk: torch.Tensor, *, first_block: int = 0) -> None:
    """Copy ``chunk`` (from its block ``first_block`` on) into the blocks ``ids`` of every
    layer (the inverse of :func:`gather`)."""
    for layer, cache in enumerate(caches):
        src = _split(layout, chunk, layer, first_block)
        if layout.kind == "flash":
            for kv in (0, 1):
                cache[kv].index_copy_(0, ids, src[kv])
        elif layout.kind == "blocks_first":
            for kv in (0, 1):
                cache[:, kv].index_copy_(0, ids, src[kv])
        elif layout.kind == "cpu_attn":
            blocks = torch.empty((len(ids), *cache.shape[1:]), dtype=cache.dtype,
                                 device=cache.device)
            k, v = _cpu_attn_halves(layout, blocks)
            k.copy_(src[0].permute(0, 2, 3, 1))  # [nb, B, H, D] -> [nb, H, D, B]
            v.copy_(src[1].permute(0, 2, 1, 3))  # [nb, B, H, D] -> [nb, H, B, D]
            cache.index_copy_(0, ids, blocks)
        else:
            cache.index_copy_(0, ids, src[0])


def _cpu_attn_halves(layout: KVLayout, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[nb, H, 2B, D]``-shaped blocks as (K ``[nb, H, D, B]``, V ``[nb, H, B, D]``)."""
    nb, h, b, d = len(blocks), layout.num_kv_heads, layout.block_size, layout.head_dim
    flat = blocks.view(nb, h, 2 * b * d)
    return flat[:, :, : b * d].view(nb, h, d, b), flat[:, :, b * d :].view(nb, h, b, d)
