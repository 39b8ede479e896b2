"""Loads into CPU blocks from where the chunks lie in a same-host node's memory.

A staged load into host-memory blocks (canonical ``cpu_attn`` chunks, K transposed or in
AMX tiles; or ``direct=False``) would receive each chunk into a staging slot, then scatter
it into the blocks. With a standalone node on the same host whose arena index the client
reads, :func:`load_in_place` scatters each chunk from the node's memory instead
(:meth:`kvpool.client.AsyncClient.read_in_place`: no request, no staging copy; the
checksum verified there first, and the chunk accepted only if the node did not free its
memory before the scatter was done). A chunk it cannot read so (not in DRAM, freed
meanwhile, another size) is received into a staging slot and scattered again from
there, so the blocks come out bit-exact either way.

One thread, in order: on CPU the staging ring overlaps a receive (a copy) with a
scatter, and here there is no receive. Measured in docs/notebook/2026-12-02-vllm.md ("Loads
in place").
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Protocol

import torch

from kvpool.client import AsyncClient
from kvpool.gpu.layout import KVLayout
from kvpool.gpu.paged import Scatter
from kvpool.protocol.errors import BufferTooSmallError

__all__ = ["InPlaceTarget", "load_in_place"]


class _Staging(Protocol):
    @property
    def host_view(self) -> memoryview: ...  # what a receive fills

    @property
    def chunk(self) -> torch.Tensor: ...  # the same bytes as the chunk array


class _Counts(Protocol):
    chunks_in_place: int
    load_misses: int


class InPlaceTarget(Protocol):
    """What a load in place reads of its connector (an ``AsyncPagedKVConnector``; named
    here so the connector and this module do not import each other)."""

    @property
    def client(self) -> AsyncClient: ...

    @property
    def layout(self) -> KVLayout: ...

    @property
    def caches(self) -> list[torch.Tensor]: ...

    @property
    def scatter(self) -> Scatter: ...

    @property
    def slots(self) -> Sequence[_Staging]: ...

    @property
    def chunk_tokens(self) -> int: ...

    @property
    def blocks_per_chunk(self) -> int: ...

    @property
    def chunk_nbytes(self) -> int: ...

    @property
    def stats(self) -> _Counts: ...


class _ForeignChunk(Exception):
    """A value of another size than this layout's chunks (read in place: a miss)."""


def _as_chunk(view: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A payload's bytes as the chunk array, without a copy."""
    with warnings.catch_warnings():  # a read-only mapping of the arena: only read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8).view(dtype).view(shape)


async def load_in_place(conn: InPlaceTarget, keys: list[bytes], ids: torch.Tensor, *,
                        first: int, found: int, skip_blocks: int) -> int:
    """Chunks ``first..found-1`` of ``keys`` into ``conn``'s blocks (``ids``: the block of
    each of their blocks, in order), the first of them from its block ``skip_blocks``
    on; the index past the last chunk loaded (a chunk neither in place nor received
    ends the load, as a staged load's miss does)."""
    layout, slot, client = conn.layout, conn.slots[0], conn.client
    shape = layout.chunk_shape(conn.chunk_tokens)
    per_chunk = conn.blocks_per_chunk
    loaded = first
    for i in range(first, found):
        fb = skip_blocks if i == first else 0
        chunk_ids = ids[i * per_chunk + fb : (i + 1) * per_chunk]

        def scatter_from(view: memoryview, chunk_ids: torch.Tensor = chunk_ids,
                         fb: int = fb) -> None:
            if view.nbytes != conn.chunk_nbytes:
                raise _ForeignChunk
            conn.scatter(layout, conn.caches, chunk_ids, _as_chunk(view, layout.dtype, shape),
                         first_block=fb)

        try:
            in_place = client.read_in_place(keys[i], scatter_from)
        except _ForeignChunk:
            in_place = False  # received below, where a foreign size is a miss
        if in_place:
            conn.stats.chunks_in_place += 1
        else:
            try:
                got = await client.get_into(keys[i], slot.host_view)
            except BufferTooSmallError:
                got = None  # not a chunk of this layout: a miss like any other
            if got != conn.chunk_nbytes:
                conn.stats.load_misses += 1
                break
            conn.scatter(layout, conn.caches, chunk_ids, slot.chunk, first_block=fb)
        loaded += 1
    return loaded
