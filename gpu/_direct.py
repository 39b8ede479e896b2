"""Where a chunk's bytes lie in an engine's paged blocks in host memory: the views a
direct transfer receives into and sends from, with no staging copy."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.client import AsyncClient
from kvpool.gpu.layout import KVLayout
from kvpool.protocol.errors import BufferTooSmallError

__all__ = ["DIRECT_BATCH", "DirectBlocks", "load_direct"]

#: chunks a direct load asks for in one request
DIRECT_BATCH = 32


class DirectBlocks:
    """One engine's host-memory KV caches as byte views of a chunk's blocks
    (``get_many_into`` receives into them, ``put`` sends from them)."""

    def __init__(self, layout: KVLayout, caches: Sequence[torch.Tensor], num_blocks: int,
                 blocks_per_chunk: int, chunk_nbytes: int) -> None:
        self.kind = layout.kind
        self.num_blocks = num_blocks
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_nbytes = chunk_nbytes
        #: each layer's bytes as one flat view (segments of the blocks, no copies)
        self._flat = [c.view(torch.uint8).numpy().data.cast("B") for c in caches]
        #: K and V planes of a layer's tensor (flash, blocks_first: 2; blocks that hold
        #: both, or MLA's one latent: 1), and one block of one plane's bytes
        self._planes = 2 if layout.kind in ("flash", "blocks_first") else 1
        self._block_bytes = caches[0].nbytes // (num_blocks * self._planes)
        #: where a direct load puts the blocks of a chunk the engine already holds
        self._scratch: memoryview | None = None

    def segments(self, ids: list[int], chunk: int, skip_blocks: int = 0
                 ) -> list[bytes | bytearray | memoryview]:
        """The chunk's bytes where they lie in the engine's blocks, in payload order: one
        view per run of consecutive blocks per layer (and K/V plane). The bytes of the
        chunk's first ``skip_blocks`` blocks go to a scratch buffer instead: blocks the
        engine already holds, which other requests may be reading, are never written."""
        b = self.blocks_per_chunk
        mine = ids[chunk * b:(chunk + 1) * b]
        size = self._block_bytes
        if self.kind == "flash":  # [2, N, ...]: plane kv's block at (kv * N + block)
            starts = [[(kv * self.num_blocks + block) * size for block in mine]
                      for kv in range(2)]
        elif self.kind == "blocks_first":  # [N, 2, ...]: (2 * block + kv)
            starts = [[(2 * block + kv) * size for block in mine] for kv in range(2)]
        else:
            starts = [[block * size for block in mine]]
        # (start, end) byte ranges of a layer, runs of adjacent blocks merged; None: scratch
        ranges: list[tuple[int, int] | None] = []
        for plane in range(self._planes):
            for j, start in enumerate(starts[plane]):
                last = ranges[-1] if ranges else None
                if j < skip_blocks:
                    ranges.append(None)
                elif last is not None and j > skip_blocks and last[1] == start:
                    ranges[-1] = (last[0], start + size)
                else:
                    ranges.append((start, start + size))
        if skip_blocks and self._scratch is None:
            self._scratch = memoryview(bytearray(self.chunk_nbytes))
        used = 0
        out: list[bytes | bytearray | memoryview] = []
        for layer in self._flat:
            for span in ranges:
                if span is None:
                    assert self._scratch is not None
                    out.append(self._scratch[used:used + size])
                    used += size
                else:
                    out.append(layer[span[0]:span[1]])
        return out


async def load_direct(client: AsyncClient, blocks: DirectBlocks, keys: list[bytes],
                      id_list: list[int], *, first: int, found: int, skip_blocks: int) -> int:
    """Chunks ``first..found-1`` of ``keys`` straight into ``blocks`` (``id_list``: the
    block of each of their blocks, in order; the first chunk from its block
    ``skip_blocks`` on), in batches of ``DIRECT_BATCH`` (one request each: the client
    copies a batch's values on several threads); the index past the last chunk loaded
    (a chunk missing, corrupt or of a foreign size ends the load there)."""
    loaded = first
    while loaded < found:
        end = min(found, loaded + DIRECT_BATCH)
        sinks = [blocks.segments(id_list, i, skip_blocks if i == first else 0)
                 for i in range(loaded, end)]
        try:
            got: list[int | None] = await client.get_many_into(keys[loaded:end], sinks)
        except BufferTooSmallError:  # a chunk of a foreign size: find it one by one
            got = []
            for key, sink in zip(keys[loaded:end], sinks, strict=True):
                try:
                    got.append(await client.get_into(key, sink))
                except BufferTooSmallError:
                    got.append(None)  # a miss like any other
                if got[-1] != blocks.chunk_nbytes:
                    break
        for n in got:
            if n != blocks.chunk_nbytes:  # missing or corrupt (None)
                break
            loaded += 1
        if loaded < end:
            break
    return loaded
