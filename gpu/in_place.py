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

With a :class:`WriteBatch` (the connector makes one for canonical ``cpu_attn`` chunks),
the chunks are copied side by side into it as they are read (one copy a chunk), and the
batch is written into the blocks as one chunk of several (one write a layer for a batch,
where vLLM's AMX cache write takes one a layer for each chunk): on a CPU engine's load
thread every torch call is a hand-over of the GIL with the engine's thread, whose
forward waits at each one. What is written is what a chunk at a time writes.
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

__all__ = ["InPlaceTarget", "WriteBatch", "load_in_place"]

#: how much a :class:`WriteBatch` holds, at most (and one chunk at least)
BATCH_BYTES = 48 << 20
#: and at most this many chunks
BATCH_CHUNKS = 8


class WriteBatch:
    """Canonical chunks (``[L, 2, T, H, D]``) of one load copied side by side into one
    buffer, then written into the blocks by one call of a :class:`Scatter` as a chunk
    of their tokens together; allocated once, with the connector, and zero-filled then
    (left to the first load, a fresh buffer's page faults made the 4k-token prompt of
    ``bench.vllm_batch``'s ``async`` way reach its first token in 0.29 s, against
    0.20-0.21 with the buffer filled beforehand: ad-hoc runs, 3 and 2 engines)."""

    def __init__(self, layout: KVLayout, chunk_tokens: int) -> None:
        nbytes = layout.chunk_nbytes(chunk_tokens)
        #: chunks it holds at most
        self.chunks = max(1, min(BATCH_CHUNKS, BATCH_BYTES // max(1, nbytes)))
        self.buffer = torch.zeros(layout.chunk_shape(self.chunks * chunk_tokens),
                                  dtype=layout.dtype)
        self._layout = layout
        self._tokens = 0  # filled so far
        self._ids: list[torch.Tensor] = []  # the blocks of what is filled, in order

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def make_room(self, blocks: int, scatter: Scatter, caches: list[torch.Tensor]) -> None:
        """:meth:`write` what it holds first if ``blocks`` more blocks would not fit."""
        if self._tokens + blocks * self._layout.block_size > self.buffer.shape[2]:
            self.write(scatter, caches)

    def add(self, chunk: torch.Tensor, ids: torch.Tensor, first_block: int) -> None:
        """Copy ``chunk`` from its block ``first_block`` on, bound for blocks ``ids``
        (:meth:`make_room` for them first)."""
        part = chunk[:, :, first_block * self._layout.block_size:]
        end = self._tokens + part.shape[2]
        self.buffer[:, :, self._tokens:end].copy_(part)
        self._tokens = end
        self._ids.append(ids)

    def undo(self, ids: torch.Tensor) -> None:
        """Forget the last :meth:`add`, if it was for ``ids`` (its bytes were no value's)."""
        if self._ids and self._ids[-1] is ids:
            self._ids.pop()
            self._tokens -= len(ids) * self._layout.block_size

    def write(self, scatter: Scatter, caches: list[torch.Tensor]) -> None:
        """Write what it holds into its blocks, and empty it."""
        if self._ids:
            ids = self._ids[0] if len(self._ids) == 1 else torch.cat(self._ids)
            scatter(self._layout, caches, ids, self.buffer[:, :, :self._tokens])
        self.clear()

    def clear(self) -> None:
        self._tokens = 0
        self._ids = []


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

    @property
    def batch(self) -> WriteBatch | None: ...


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
    layout, slot, client, batch = conn.layout, conn.slots[0], conn.client, conn.batch
    shape = layout.chunk_shape(conn.chunk_tokens)
    per_chunk = conn.blocks_per_chunk

    def write(chunk: torch.Tensor, chunk_ids: torch.Tensor, fb: int) -> None:
        if batch is None:
            conn.scatter(layout, conn.caches, chunk_ids, chunk, first_block=fb)
        else:
            batch.add(chunk, chunk_ids, fb)

    loaded = first
    try:
        for i in range(first, found):
            fb = skip_blocks if i == first else 0
            chunk_ids = ids[i * per_chunk + fb : (i + 1) * per_chunk]
            # room made here, not in scatter_from, where the chunk's memory is held
            if batch is not None:
                batch.make_room(len(chunk_ids), conn.scatter, conn.caches)

            def scatter_from(view: memoryview, chunk_ids: torch.Tensor = chunk_ids,
                             fb: int = fb) -> None:
                if view.nbytes != conn.chunk_nbytes:
                    raise _ForeignChunk
                write(_as_chunk(view, layout.dtype, shape), chunk_ids, fb)

            try:
                in_place = client.read_in_place(keys[i], scatter_from)
            except _ForeignChunk:
                in_place = False  # received below, where a foreign size is a miss
            if in_place:
                conn.stats.chunks_in_place += 1
            else:
                if batch is not None:  # a copy made while its memory was reused
                    batch.undo(chunk_ids)
                try:
                    got = await client.get_into(keys[i], slot.host_view)
                except BufferTooSmallError:
                    got = None  # not a chunk of this layout: a miss like any other
                if got != conn.chunk_nbytes:
                    conn.stats.load_misses += 1
                    break
                write(slot.chunk, chunk_ids, fb)
            loaded += 1
    except BaseException:
        if batch is not None:
            batch.clear()  # the load failed: its blocks are all recomputed
        raise
    if batch is not None:  # every chunk it holds was read whole
        batch.write(conn.scatter, conn.caches)
    return loaded
