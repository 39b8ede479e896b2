"""Load chunks from kvpool straight into an engine's paged KV blocks, and store them back.

``AsyncPagedKVConnector`` is the implementation; ``PagedKVConnector`` runs it
on a blocking :class:`kvpool.client.Client`'s loop.

**load(tokens, block_ids)**, staged (CUDA; canonical chunks of the CPU_ATTN
kinds): one lookup round trip finds how many leading chunks the pool holds;
then a pipeline over those chunks: chunk *i* is
received (``get_into``, checksummed as it arrives) straight into pinned
staging slot *i mod k* while chunk *i-1* is copied host-to-device on a side
CUDA stream (``non_blocking``) and scattered into the engine's blocks
(``index_copy_``). Up to *k* receives are in flight; a slot is received into
again only once its previous copy has finished (its CUDA event). The
engine's current stream is made to wait for the side stream before ``load``
returns, so the engine's kernels see the blocks and nothing else waits. A
chunk that is missing or fails its checksum ends the load at the previous
chunk: the blocks of later chunks are not touched, and the return value
tells the engine where to start recomputing. Direct (host memory, nothing to
convert): the chunks are received straight into the blocks, up to
``DIRECT_BATCH`` a request and no lookup first; a chunk missing or corrupt
still ends the load there, but later chunks of its batch may have been written
into their blocks (which the engine recomputes, as it does any block past the
returned count).

**store(tokens, block_ids)**: one EXISTS round trip skips chunks the pool
already has; each remaining chunk's blocks are gathered on the device into a
contiguous buffer (``index_select``), copied into a pinned host slot, and
put, with the gather of the next chunk overlapping the put of this one.

Buffers: *k* host slots (pinned when the caches are on CUDA) and, on CUDA, *k*
device slots, allocated once when the connector is made and kept for its
life (and, for ``bhnc`` views, one layer's blocks of scratch a slot, which the
gather reads the engine's strided blocks into), so nothing on the hot path
allocates tensor memory but each call's few-byte block-id tensor, and the
caching allocator can never hand a slot to someone else while a copy uses it. The
device-side work runs on one "copy" thread, which on CUDA only enqueues work
on the side stream and waits on its events, and on CPU does the copies
itself (torch releases the GIL), so receiving the next chunk overlaps it in
both cases. Without CUDA the identical code runs on CPU tensors: pinning,
the side stream and events are skipped, and the device slot is the host
slot; canonical chunks bound for ``cpu_attn`` blocks are copied from the slots
into a write batch (one buffer of up to 8 chunks, also allocated once) and
written into the blocks a batch at a time, as a load in place writes them
(:mod:`kvpool.gpu.in_place` says why).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from kvpool.client import AsyncClient, Client
from kvpool.gpu._direct import DirectBlocks, load_direct
from kvpool.gpu.in_place import WriteBatch, load_in_place
from kvpool.gpu.layout import CPU_ATTN_KINDS, KVLayout
from kvpool.gpu.paged import Scatter, gather, gather_scratch_shape, scatter, scatter_for
from kvpool.placement.keys import ChunkHasher, Namespace
from kvpool.protocol.errors import BufferTooSmallError, LayoutError

__all__ = ["AsyncPagedKVConnector", "ConnectorStats", "PagedKVConnector"]

DEFAULT_STAGING_SLOTS = 4


@dataclass
class ConnectorStats:
    """Counters since the connector was made (``connector.stats``)."""

    loads: int = 0
    tokens_loaded: int = 0
    bytes_loaded: int = 0
    load_misses: int = 0  #: loads that ended early on a missing or corrupt chunk
    #: chunks a load scattered into CPU blocks from where they lie in a same-host node's
    #: memory (no request, no staging copy: ``AsyncClient.read_in_place``)
    chunks_in_place: int = 0
    stores: int = 0
    tokens_stored: int = 0
    bytes_stored: int = 0
    chunks_skipped: int = 0  #: chunks a store found already in the pool


@dataclass
class _Slot:
    host: torch.Tensor  #: uint8, pinned on CUDA
    device: torch.Tensor  #: uint8 on the caches' device (the host slot itself on CPU)
    chunk: torch.Tensor  #: ``device`` viewed as the chunk payload array
    host_view: memoryview  #: what get_into receives into and put sends from
    event: Any = None  #: torch.cuda.Event on CUDA
    #: ``bhnc`` only: one layer's blocks of a chunk, dense, on the device (the gather
    #: reads the engine's strided blocks into it, then reorders them into ``chunk``)
    scratch: torch.Tensor | None = None
    busy: Awaitable[Any] | None = field(default=None, repr=False)

    @classmethod
    def make(cls, layout: KVLayout, chunk_tokens: int, device: torch.device) -> _Slot:
        """A slot for one chunk (host memory pinned, and a device copy, on CUDA)."""
        cuda = device.type == "cuda"
        host = torch.empty(layout.chunk_nbytes(chunk_tokens), dtype=torch.uint8,
                           pin_memory=cuda)
        on_device = torch.empty_like(host, device=device) if cuda else host
        chunk = on_device.view(layout.dtype).view(layout.chunk_shape(chunk_tokens))
        event = torch.cuda.Event() if cuda else None  # type: ignore[no-untyped-call]
        scratch = None
        if layout.kind == "bhnc":
            scratch = torch.empty(gather_scratch_shape(layout, chunk_tokens),
                                  dtype=layout.dtype, device=device)
        return cls(host, on_device, chunk, host.numpy().data.cast("B"), event, scratch)


def tokens_list(tokens: Sequence[int] | torch.Tensor) -> list[int]:
    """Token ids as a list of ints (from a list, or a tensor of any shape)."""
    if isinstance(tokens, torch.Tensor):
        return [int(t) for t in tokens.reshape(-1).tolist()]
    return list(tokens)


def _id_list(block_ids: Sequence[int] | torch.Tensor, count: int, num_blocks: int
             ) -> list[int]:
    """The first ``count`` block ids, as ints; LayoutError if there are fewer or one is
    outside ``[0, num_blocks)``."""
    ids = block_ids[:count] if not isinstance(block_ids, torch.Tensor) \
        else block_ids.reshape(-1)[:count].tolist()
    ids = [int(i) for i in ids]
    if len(ids) < count:
        raise LayoutError(f"{count} block ids needed, got {len(ids)}")
    if ids and (min(ids) < 0 or max(ids) >= num_blocks):
        raise LayoutError(f"block ids must be in [0, {num_blocks}), got "
                          f"{min(ids)}..{max(ids)}")
    return ids


P = ParamSpec("P")
T = TypeVar("T")


def _one_at_a_time(method: Callable[Concatenate[AsyncPagedKVConnector, P], Coroutine[Any, Any, T]]
                   ) -> Callable[Concatenate[AsyncPagedKVConnector, P], Coroutine[Any, Any, T]]:
    """Loads and stores of one connector run one after another, in the order called: they
    share its staging slots and write batch (two staged loads at once into one connector
    wrote each other's chunks into their blocks)."""
    @functools.wraps(method)
    async def in_turn(conn: AsyncPagedKVConnector, /, *args: P.args, **kwargs: P.kwargs) -> T:
        async with conn._turn:
            return await method(conn, *args, **kwargs)

    return in_turn


class AsyncPagedKVConnector:
    """Moves chunks between kvpool and one engine's paged KV tensors (see the module doc).

    ``kv_caches``: the engine's per-layer paged tensors (or one tensor with a
    leading layer dimension), checked against ``layout`` up front.
    ``namespace``: from ``layout.namespace(model, ...)``; every engine that
    should share chunks must use the same one.
    ``scatter``: what a staged load writes each chunk into the blocks with (default
    :func:`kvpool.gpu.paged.scatter`; an engine may bring its own, faster op).
    ``in_place``: a staged load into CPU blocks reads each chunk where it lies in a
    same-host node's memory (:mod:`kvpool.gpu.in_place`).
    ``batch_loads``: a staged load of canonical chunks into CPU ``cpu_attn`` blocks
    copies them into a :class:`~kvpool.gpu.in_place.WriteBatch` and writes them into
    the blocks up to 8 at a time (up to 48 MiB of host memory, allocated with the
    connector); False for a connector that only stores.
    """

    def __init__(self, client: AsyncClient, layout: KVLayout,
                 kv_caches: torch.Tensor | Sequence[torch.Tensor], namespace: Namespace, *,
                 staging_slots: int = DEFAULT_STAGING_SLOTS, direct: bool | None = None,
                 scatter: Scatter = scatter, in_place: bool = True,
                 batch_loads: bool = True) -> None:
        if staging_slots < 1:
            raise LayoutError("staging_slots must be >= 1")
        layout.check_namespace(namespace)
        self.client = client
        self.layout = layout
        self.caches = layout.check(kv_caches)
        self.namespace = namespace
        self.hasher = ChunkHasher(namespace)
        self.chunk_tokens = namespace.chunk_tokens
        self.blocks_per_chunk = self.chunk_tokens // layout.block_size
        self.chunk_nbytes = layout.chunk_nbytes(self.chunk_tokens)
        self.num_blocks = layout.num_blocks_of(self.caches[0])
        self.device = self.caches[0].device
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None  # type: ignore[no-untyped-call]
        self.stats = ConnectorStats()
        #: what writes a chunk into the blocks (staged loads)
        self.scatter = scatter_for(layout, self.caches, scatter)
        #: staged loads into CPU blocks scatter chunks from a same-host node's memory
        self.in_place = in_place and not self.cuda
        if direct is None:
            direct = not self.cuda and not layout.converts
        if direct and self.cuda:
            raise LayoutError("direct transfers need the KV caches in host memory")
        if direct and layout.converts:
            raise LayoutError(f"{layout.kind} blocks do not hold canonical chunks' bytes in "
                              "order (K packed or transposed, or heads before tokens): "
                              "canonical chunks go through staging (direct=False)"
                              + (", or use chunk_format='engine'"
                                 if layout.kind in CPU_ATTN_KINDS else ""))
        self.direct = direct
        #: chunks in flight at once (receives or puts); the staging ring's size
        self.depth = staging_slots
        self.slots = [] if direct else [_Slot.make(layout, self.chunk_tokens, self.device)
                                         for _ in range(staging_slots)]
        #: the chunks' bytes where they lie in the blocks (direct transfers)
        self.blocks = DirectBlocks(layout, self.caches, self.num_blocks, self.blocks_per_chunk,
                                   self.chunk_nbytes) if direct else None
        #: staged loads into CPU blocks gather canonical ``cpu_attn`` chunks here and write
        #: them into the blocks several at a time (:mod:`kvpool.gpu.in_place` says why)
        self.batch = WriteBatch(layout, self.chunk_tokens) if batch_loads and not direct \
            and not self.cuda and layout.kind in CPU_ATTN_KINDS \
            and not layout.engine_format else None
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-copy")
        self._turn = asyncio.Lock()  # loads and stores, one at a time (_one_at_a_time)

    def close(self) -> None:
        self._copier.shutdown(wait=True)

    # -- helpers --------------------------------------------------------------------------

    def _segments(self, ids: list[int], chunk: int, skip_blocks: int = 0
                  ) -> list[bytes | bytearray | memoryview]:
        assert self.blocks is not None  # (direct transfers only)
        return self.blocks.segments(ids, chunk, skip_blocks)

    def _block_ids(self, ids: list[int]) -> torch.Tensor:
        tensor = torch.tensor(ids, dtype=torch.long).to(self.device)
        if self.stream is not None:
            # the side stream starts after the engine's queued work (which made ``tensor``
            # and may still use the blocks), and the allocator keeps ``tensor`` for it
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            tensor.record_stream(self.stream)
        return tensor

    def _chunk_ids(self, ids: torch.Tensor, chunk: int) -> torch.Tensor:
        b = self.blocks_per_chunk
        return ids[chunk * b:(chunk + 1) * b]

    def _run_copy(self, fn: Any, *args: Any) -> asyncio.Future[None]:
        return asyncio.wrap_future(self._copier.submit(fn, *args))

    def _to_device(self, slot: _Slot, ids: torch.Tensor, first_block: int = 0) -> None:
        """Copy thread: staging slot -> the engine's blocks (from the chunk's
        ``first_block`` on; ``ids`` names those blocks)."""
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                slot.device.copy_(slot.host, non_blocking=True)
                self.scatter(self.layout, self.caches, ids, slot.chunk,
                              first_block=first_block)
                slot.event.record(self.stream)
            slot.event.synchronize()  # the host slot may be received into again
        elif self.batch is not None:  # into the blocks a batch at a time (_load_staged)
            self.batch.make_room(len(ids), self.scatter, self.caches)
            self.batch.add(slot.chunk, ids, first_block)
        else:
            self.scatter(self.layout, self.caches, ids, slot.chunk, first_block=first_block)

    def _to_host(self, slot: _Slot, ids: torch.Tensor) -> None:
        """Copy thread: the engine's blocks -> staging slot."""
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                gather(self.layout, self.caches, ids, slot.chunk, scratch=slot.scratch)
                slot.host.copy_(slot.device, non_blocking=True)
                slot.event.record(self.stream)
            slot.event.synchronize()  # the bytes are on the host: put may send them
        else:
            gather(self.layout, self.caches, ids, slot.chunk, scratch=slot.scratch)

    def _limit(self, tokens: list[int], block_ids: Sequence[int] | torch.Tensor,
               max_tokens: int | None) -> int:
        limit = min(len(tokens), len(block_ids) * self.layout.block_size)
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        return max(0, limit) // self.chunk_tokens

    # -- the two operations ---------------------------------------------------------------

    @_one_at_a_time
    async def load(self, tokens: Sequence[int] | torch.Tensor,
                   block_ids: Sequence[int] | torch.Tensor, *,
                   max_tokens: int | None = None, skip_tokens: int = 0) -> int:
        """Fill the engine's blocks with the longest cached prefix of ``tokens``.

        ``block_ids[j]`` is the engine block holding tokens ``[j*B, (j+1)*B)``.
        Loads at most ``max_tokens`` tokens (an engine that needs logits for the
        last prompt token passes ``len(tokens) - 1``). Returns the number of
        tokens loaded, a multiple of ``chunk_tokens``; the engine computes the rest.

        ``skip_tokens`` (a multiple of the block size): the engine already holds
        that many leading tokens (its own prefix cache); their blocks are not
        written, chunks wholly inside them are not fetched, and the return value
        counts them as present (the length of the prefix now in the blocks).
        """
        tokens = tokens_list(tokens)
        wanted = self._limit(tokens, block_ids, max_tokens)
        if skip_tokens % self.layout.block_size:
            raise LayoutError(f"skip_tokens ({skip_tokens}) must be a multiple of the block "
                              f"size ({self.layout.block_size})")
        first = max(0, skip_tokens) // self.chunk_tokens
        self.stats.loads += 1
        if wanted <= first:
            return wanted * self.chunk_tokens if skip_tokens else 0
        keys = self.hasher.keys(tokens[: wanted * self.chunk_tokens])
        # a direct load asks for every chunk at once: its answer says which are there, so
        # a lookup first would cost a round trip for nothing. A staged one looks up first:
        # the slots go to chunks that are there, and a lookup settles without a node that
        # does not answer, marking it so the reads keep away from it (a read waits for its
        # node: a hung one it meets first costs the client's timeout)
        found = wanted if self.direct else first + await self.client.lookup(keys[first:])
        if found == first:
            return first * self.chunk_tokens
        id_list = _id_list(block_ids, found * self.blocks_per_chunk, self.num_blocks)
        skip_blocks = skip_tokens // self.layout.block_size - first * self.blocks_per_chunk
        if self.direct:
            assert self.blocks is not None
            loaded = await load_direct(self.client, self.blocks, keys, id_list, first=first,
                                       found=found, skip_blocks=skip_blocks)
            if loaded < found:  # missing, corrupt or of a foreign size
                self.stats.load_misses += 1
        else:
            loaded = await self._load_staged(keys, id_list, first, found, skip_blocks)
        self.stats.tokens_loaded += (loaded - first) * self.chunk_tokens
        self.stats.bytes_loaded += (loaded - first) * self.chunk_nbytes
        return loaded * self.chunk_tokens

    async def _load_staged(self, keys: list[bytes], id_list: list[int], first: int,
                           found: int, skip_blocks: int) -> int:
        """Chunks ``first..found-1`` through the staging ring (see the module doc); the
        index past the last chunk loaded."""
        if self.in_place and self.client.can_read_in_place:
            return await load_in_place(self, keys, self._block_ids(id_list), first=first,
                                       found=found, skip_blocks=skip_blocks)
        ids = self._block_ids(id_list)
        k = self.depth
        receives: dict[int, asyncio.Task[int | None]] = {}

        async def receive(i: int) -> int | None:
            slot = self.slots[(i - first) % k]
            if slot.busy is not None:
                await slot.busy  # the copy of chunk i-k has left this slot
            try:
                return await self.client.get_into(keys[i], slot.host_view)
            except BufferTooSmallError:
                return None  # not a chunk of this layout: a miss like any other

        loaded = first
        whole = False
        try:
            for i in range(first, min(first + k, found)):
                receives[i] = asyncio.create_task(receive(i))
            for i in range(first, found):
                got = await receives.pop(i)
                if got != self.chunk_nbytes:  # missing, corrupt (None) or a foreign size
                    self.stats.load_misses += 1
                    break
                slot = self.slots[(i - first) % k]
                fb = skip_blocks if i == first else 0
                slot.busy = self._run_copy(self._to_device, slot,
                                           self._chunk_ids(ids, i)[fb:], fb)
                if i + k < found:
                    receives[i + k] = asyncio.create_task(receive(i + k))
                loaded += 1
            whole = True
        finally:
            # never leave a receive writing into a slot, or a copy reading one, behind us
            await asyncio.gather(*receives.values(), return_exceptions=True)
            await self._settle()
            if not whole and self.batch is not None:
                self.batch.clear()  # the load failed: its blocks are all recomputed
        if self.batch is not None:  # what the copies left in it (each chunk received whole)
            await self._run_copy(self.batch.write, self.scatter, self.caches)
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return loaded

    @_one_at_a_time
    async def store(self, tokens: Sequence[int] | torch.Tensor,
                    block_ids: Sequence[int] | torch.Tensor) -> int:
        """Store every full chunk of ``tokens`` the pool does not have yet.

        Call it once the engine's kernels that wrote these blocks are queued
        (the side stream waits for the engine's current stream). Returns the
        number of tokens newly stored.
        """
        tokens = tokens_list(tokens)
        count = self._limit(tokens, block_ids, None)
        self.stats.stores += 1
        if count == 0:
            return 0
        keys = self.hasher.keys(tokens[: count * self.chunk_tokens])
        present = await self.client.exists_many(keys)
        todo = [i for i, p in enumerate(present) if not p]
        self.stats.chunks_skipped += count - len(todo)
        if not todo:
            return 0
        id_list = _id_list(block_ids, count * self.blocks_per_chunk, self.num_blocks)
        k = self.depth
        digest = self.namespace.digest
        if self.direct:  # puts straight from the blocks, ``depth`` at a time
            puts: set[asyncio.Task[None]] = set()
            try:
                for i in todo:
                    if len(puts) >= k:
                        done, puts = await asyncio.wait(puts,
                                                        return_when=asyncio.FIRST_COMPLETED)
                        for task in done:
                            task.result()
                    puts.add(asyncio.create_task(self.client.put(
                        keys[i], self._segments(id_list, i), chunk_index=i,
                        num_tokens=self.chunk_tokens, fingerprint=digest,
                        parent=keys[i - 1] if i else None)))
                for result in await asyncio.gather(*puts, return_exceptions=True):
                    if isinstance(result, BaseException):
                        raise result
            finally:
                await asyncio.gather(*puts, return_exceptions=True)
        else:
            ids = self._block_ids(id_list)
            try:
                for j, i in enumerate(todo):
                    slot = self.slots[j % k]
                    if slot.busy is not None:
                        await slot.busy  # the put of chunk j-k has sent this slot
                        slot.busy = None
                    await self._run_copy(self._to_host, slot, self._chunk_ids(ids, i))
                    slot.busy = asyncio.ensure_future(self.client.put(
                        keys[i], slot.host_view, chunk_index=i, num_tokens=self.chunk_tokens,
                        fingerprint=digest, parent=keys[i - 1] if i else None))
                await self._settle(raise_errors=True)
            finally:
                await self._settle()
        self.stats.tokens_stored += len(todo) * self.chunk_tokens
        self.stats.bytes_stored += len(todo) * self.chunk_nbytes
        return len(todo) * self.chunk_tokens

    async def _settle(self, raise_errors: bool = False) -> None:
        """Wait until no copy or put uses any slot; re-raise the first error if asked."""
        busy = [s.busy for s in self.slots if s.busy is not None]
        for slot in self.slots:
            slot.busy = None
        results = await asyncio.gather(*busy, return_exceptions=True)
        if raise_errors:
            for result in results:
                if isinstance(result, BaseException):
                    raise result


class PagedKVConnector:
    """Blocking facade of :class:`AsyncPagedKVConnector` over a :class:`kvpool.client.Client`."""

    def __init__(self, client: Client, layout: KVLayout,
                 kv_caches: torch.Tensor | Sequence[torch.Tensor], namespace: Namespace, *,
                 staging_slots: int = DEFAULT_STAGING_SLOTS, direct: bool | None = None,
                 scatter: Scatter = scatter, in_place: bool = True,
                 batch_loads: bool = True) -> None:
        self._client = client
        self._async = AsyncPagedKVConnector(client.async_client, layout, kv_caches, namespace,
                                            staging_slots=staging_slots, direct=direct,
                                            scatter=scatter, in_place=in_place,
                                            batch_loads=batch_loads)

    @property
    def stats(self) -> ConnectorStats:
        return self._async.stats

    @property
    def chunk_tokens(self) -> int:
        return self._async.chunk_tokens

    @property
    def layout(self) -> KVLayout:
        return self._async.layout

    @property
    def device(self) -> torch.device:
        """Where the engine's KV caches are."""
        return self._async.device

    @property
    def stream(self) -> Any:
        """The side CUDA stream its copies run on (None off CUDA)."""
        return self._async.stream

    @property
    def staging_nbytes(self) -> int:
        """Bytes of its staging slots on the caches' device (as many again pinned on the
        host when that is a GPU), and of its write batch; 0 for direct transfers."""
        batch = self._async.batch
        return sum(slot.device.nbytes + (slot.scratch.nbytes if slot.scratch is not None
                                         else 0) for slot in self._async.slots) \
            + (batch.nbytes if batch is not None else 0)

    def load(self, tokens: Sequence[int] | torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
             *, max_tokens: int | None = None, skip_tokens: int = 0) -> int:
        return self._client.run(self._async.load(tokens, block_ids, max_tokens=max_tokens,
                                                 skip_tokens=skip_tokens))

    def store(self, tokens: Sequence[int] | torch.Tensor,
              block_ids: Sequence[int] | torch.Tensor) -> int:
        return self._client.run(self._async.store(tokens, block_ids))

    def close(self) -> None:
        self._async.close()

    def __enter__(self) -> PagedKVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

