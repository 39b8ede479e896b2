"""Gather a chunk's blocks out of an engine's paged KV tensors, and scatter them back.

Both work on preallocated buffers (``out=`` / in place), so the hot path
allocates no tensor memory: ``chunk`` is a dense view of a staging slot shaped
``layout.chunk_shape(chunk_tokens)``, ``ids`` the chunk's block ids (a long
tensor on the caches' device, ``chunk_tokens // block_size`` of them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.gpu.layout import KVLayout

__all__ = ["gather", "scatter"]


def _split(layout: KVLayout, chunk: torch.Tensor, layer: int, nblocks: int) -> torch.Tensor:
    """Layer ``layer`` of ``chunk`` seen as blocks: [2, nb, B, H, D] or [nb, B, D] (MLA)."""
    b = layout.block_size
    if layout.kind == "mla":
        return chunk[layer].view(nblocks, b, layout.head_dim)
    return chunk[layer].view(2, nblocks, b, layout.num_kv_heads, layout.head_dim)


def gather(layout: KVLayout, caches: Sequence[torch.Tensor], ids: torch.Tensor,
           chunk: torch.Tensor) -> None:
    """Copy the blocks ``ids`` of every layer into ``chunk`` (the chunk payload layout)."""
    nb = len(ids)
    for layer, cache in enumerate(caches):
        dst = _split(layout, chunk, layer, nb)
        if layout.kind == "flash":
            torch.index_select(cache, 1, ids, out=dst)
        elif layout.kind == "blocks_first":
            for kv in (0, 1):  # cache[:, kv] is a strided [num_blocks, B, H, D] view
                torch.index_select(cache[:, kv], 0, ids, out=dst[kv])
        else:
            torch.index_select(cache, 0, ids, out=dst)


def scatter(layout: KVLayout, caches: Sequence[torch.Tensor], ids: torch.Tensor,
            chunk: torch.Tensor) -> None:
    """Copy ``chunk`` into the blocks ``ids`` of every layer (the inverse of :func:`gather`)."""
    nb = len(ids)
    for layer, cache in enumerate(caches):
        src = _split(layout, chunk, layer, nb)
        if layout.kind == "flash":
            cache.index_copy_(1, ids, src)
        elif layout.kind == "blocks_first":
            for kv in (0, 1):
                cache[:, kv].index_copy_(0, ids, src[kv])
        else:
            cache.index_copy_(0, ids, src)
