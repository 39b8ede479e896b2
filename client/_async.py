"""The async SDK core: one node or a cluster. The sync :class:`kvpool.client.Client` wraps it.

Give it one node URL or a list of seeds. On connect it says HELLO to the
first seed that answers; a cluster node hands over the cluster map, a
standalone node is its own one-node map (epoch 0), and from then on the
client routes by itself:
each key goes to the nodes of its preference list (owners, then
fallbacks), batches are split by node and sent in parallel, one pipelined
connection pool per node.

- reads go to the first live owner; on a miss or a failure, to the next node
  of the list (owners, then fallbacks: a node that just lost a key to a
  joining node is its first fallback), then to draining nodes;
- writes go to the first ``replication`` live nodes of the list (so to a
  fallback while an owner is down);
- EXISTS/lookups ask every live node of the list at once (and draining nodes
  for what they did not find) and keep the fastest tier; DELETE, PIN and
  UNPIN go to every live node of the list;
- a node that fails is marked down with exponential back-off; a reply from a
  newer map epoch triggers a map refresh, and WRONG_OWNER a refresh and retry;
- a node on the same host that grants it (see ``kvpool.server.data.shm``) serves
  GETs through shared memory: the client copies values straight from the
  node's arena (``shm=None``, the default: wherever a node offers it;
  ``True``: required, connecting fails otherwise; ``False``: always TCP).
  Where the node also grants writes (a client of its own user), put calls
  whose values total at least ``shm_put_min_bytes`` (1 MiB) write them into
  arena slots the node reserved; smaller calls go over TCP (one round trip,
  not two). GETs look each key up first in the node's *arena index* (shared
  memory too) and copy what it has with no request at all, then report those
  reads in one TOUCH they do not wait for; keys not there go as GET_SHM
  (``shm_index=False``: always GET_SHM, a round trip per call).

Security: ``token`` (default ``$KVPOOL_TOKEN``) is sent in HELLO to nodes that
require one; it names a tenant and a role, and the node keeps every tenant's
chunks apart. ``scope="shared"`` addresses the cluster-wide shared scope
(every tenant reads it, admins write it); ``"raw"`` addresses stored keys
(admins only: node-to-node tools). ``ssl`` is an ``ssl.SSLContext`` for
nodes that serve TLS (``ssl.create_default_context(cafile=...)``, plus
``load_cert_chain`` for client certificates).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl as ssl_module
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, NamedTuple, TypeVar, cast

from opentelemetry.trace import TracerProvider

from kvpool.client import _cluster_ops as cluster_ops
from kvpool.client._connection import BufferOrSegments
from kvpool.client._node import (
    DEFAULT_PORT,
    Key,
    NodeClient,
    check_u32,
    join_keys,
    key_bytes,
    parse_seeds,
    parse_url,
    ttl_ms_of,
)
from kvpool.client._options import BUSY_POLL_US, SHM_PUT_MIN_BYTES, ClientOptions
from kvpool.client._plans import as_segments, flat_view
from kvpool.client._router import Router
from kvpool.client._tracing import explicit_tracer, traced, tracer_for
from kvpool.client.transport import Transport
from kvpool.placement.cluster_map import ClusterMap
from kvpool.protocol.envelope import ZERO_FINGERPRINT
from kvpool.protocol.errors import (
    CapacityError,
    KvpoolConnectionError,
    NotDurableError,
    Status,
    error_for_status,
)
from kvpool.protocol.frames import PUT_FLAG_PIN, Op, tier_names
from kvpool.protocol.parsers import Segments

__all__ = ["AsyncClient", "Key", "parse_url"]

log = logging.getLogger("kvpool.client")

T = TypeVar("T")


def get_sinks(keys: Sequence[Key], buffers: Sequence[BufferOrSegments]
           ) -> list[memoryview | Segments]:
    """The parser's sinks of ``get_many_into``'s buffers (a list or tuple: one readv)."""
    if len(keys) != len(buffers):
        raise ValueError("get_many_into needs one buffer per key")
    sinks: list[memoryview | Segments] = []
    for b in buffers:
        if isinstance(b, (list, tuple)):
            views = as_segments(b)
            if any(v.readonly for v in views):
                raise ValueError("get_into needs a writable buffer")
            sinks.append(Segments(views))
        else:
            view = flat_view(b)
            if view.readonly:
                raise ValueError("get_into needs a writable buffer")
            sinks.append(view)
    return sinks


def as_bytearrays(results: Sequence[memoryview | Segments | None]) -> list[bytearray | None]:
    # with no caller sinks each payload was received (or copied) into a bytearray of its own
    return [cast(bytearray, cast(memoryview, r).obj) if r is not None else None
            for r in results]


#: a seed that has not answered within this long gets company: the next one is tried
#: alongside it (a hung seed costs a connect this much, not the client's timeout)
SEED_STAGGER_S = 0.25


async def _reach(seeds: Sequence[tuple[str, int]], options: ClientOptions, router: Router
                 ) -> tuple[NodeClient, ClusterMap]:
    """The first seed to say HELLO and hand over its map, and that map. Seeds are tried in
    order, each next one once those before it failed or ``SEED_STAGGER_S`` passed with no
    answer (the earlier ones still running); the attempts left are then cancelled and
    their connections closed. The last connection error where no seed answers; any other
    error (a refused token, say) as soon as a seed gives it."""
    async def attempt(host: str, port: int) -> tuple[NodeClient, ClusterMap]:
        node = NodeClient(host, port, options)
        try:
            await node.connect()
            return node, await router.map_from(node)
        except BaseException:
            node.close()
            raise

    waiting = list(seeds)
    running: set[asyncio.Future[tuple[NodeClient, ClusterMap]]] = set()
    answers: list[tuple[NodeClient, ClusterMap]] = []
    error: BaseException | None = None
    try:
        while (waiting or running) and not answers:
            if waiting:
                running.add(asyncio.ensure_future(attempt(*waiting.pop(0))))
            done, running = await asyncio.wait(
                running, timeout=SEED_STAGGER_S if waiting else None,
                return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if exc is None:
                    answers.append(task.result())
                elif isinstance(exc, KvpoolConnectionError):
                    error = exc
                else:
                    for node, _ in answers:  # answered alongside: not used
                        node.close()
                    raise exc
    finally:
        for task in running:
            task.cancel()
        if running:  # their connections closed before this returns
            await asyncio.wait(running)
    for node, _ in answers[1:]:  # seeds that answered together: the first one is used
        node.close()
    if answers:
        return answers[0]
    assert error is not None
    raise error


class AsyncClient:
    """Async client of one kvpool node or a cluster (see the module docstring).

    Values are stored inside a checksummed envelope; every read is verified
    as it arrives. A value that fails verification is treated as a **miss**
    (``get`` returns None), counted in :attr:`num_corrupt`, and deleted from
    the node so the next writer replaces it.

    ``url``: a node URL (``kvpool://host:port`` or ``host:port``), a list of them, or
    comma-separated seeds as ``kvpool cluster up`` prints them; any one node of a cluster
    is enough (it hands out the map). Default: ``$KVPOOL_URL``, else kvpool://127.0.0.1:7700.
    ``token`` defaults to ``$KVPOOL_TOKEN``. ``transport``: how connections reach the
    nodes (default TCP; :class:`~kvpool.client.transport.MockTransport` answers them in
    this process, for tests). ``busy_poll_us``: how long the sync :class:`Client`'s
    blocking sockets poll for a reply before the thread sleeps (this client's own calls,
    on its event loop, never do).
    """

    def __init__(self, url: str | Sequence[str] | None = None, *,
                 pool_size: int = 2, timeout: float = 10.0, connect_timeout: float = 5.0,
                 client_name: str = "kvpool-python",
                 tracer_provider: TracerProvider | None = None,
                 shm: bool | None = None, token: str | None = None, scope: str = "tenant",
                 ssl: ssl_module.SSLContext | None = None,
                 shm_put_min_bytes: int = SHM_PUT_MIN_BYTES, shm_index: bool = True,
                 transport: Transport | None = None,
                 busy_poll_us: float = BUSY_POLL_US) -> None:
        if url is None:
            url = os.environ.get("KVPOOL_URL") or f"kvpool://127.0.0.1:{DEFAULT_PORT}"
        self.seeds = parse_seeds(url)  # ConfigError when it names no node
        self.host, self.port = self.seeds[0]
        if token is None:
            token = os.environ.get("KVPOOL_TOKEN", "")
        #: every node's settings (ConfigError now for a bad one, not at connect)
        self.options = ClientOptions(pool_size=pool_size, timeout=timeout,
                                     connect_timeout=connect_timeout, client_name=client_name,
                                     shm=shm, token=token, scope=scope, ssl=ssl,
                                     shm_put_min_bytes=shm_put_min_bytes, shm_index=shm_index,
                                     transport=transport, busy_poll_us=busy_poll_us)
        self.timeout = timeout
        #: where client spans go; None: the application's global provider (no spans, and no
        #: trace context on the wire, unless it installed an SDK provider)
        self.tracer_provider = tracer_provider
        self.tracer = explicit_tracer(tracer_provider)
        #: the map and a NodeClient per node of it (empty until connected)
        self._router = Router(self.options)
        self._connect_lock = asyncio.Lock()

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def server_info(self) -> dict[str, Any]:
        """What the (first) node said in HELLO: limits, protocol, node id, epoch."""
        node = next(iter(self._router.nodes.values()), None)
        return node.server_info if node is not None else {}

    @property
    def num_corrupt(self) -> int:
        return self._router.num_corrupt_gone + self._router.total(lambda n: n.num_corrupt)

    @property
    def num_left_behind(self) -> int:
        """How many times a lookup or EXISTS on a cluster stopped waiting for a node that was
        still silent once every key had its answer (the node is then kept from reads and
        writes until it answers: docs/cluster.md)."""
        return self._router.left_behind_gone + self._router.total(lambda n: n.left_behind)

    @property
    def epoch(self) -> int:
        """The cluster-map epoch this client routes by (0 = standalone node)."""
        return self.map.epoch if self.map is not None else 0

    @property
    def map(self) -> ClusterMap | None:
        """The map this client routes by (None until connected): a cluster's, or a
        standalone node's own one-node map (epoch 0, ``map.is_standalone``)."""
        return self._router.map

    async def connect(self) -> None:
        """Reach the first seed that answers (otherwise the first call does): see
        :func:`_reach`."""
        if self.map is None:
            async with self._connect_lock:
                if self._router.map is None:  # (else another task connected meanwhile)
                    node, cmap = await _reach(self.seeds, self.options, self._router)
                    self._router.install(cmap, seed=node)

    async def close(self) -> None:
        self._router.close()

    @property
    def shm_retries(self) -> int:
        """Fast-path values freed while being copied, and so fetched again over TCP."""
        return self._router.total(lambda n: n.path.shm_torn)

    @property
    def shm_index_hits(self) -> int:
        """Values read through the nodes' arena indexes, with no request."""
        return self._router.total(lambda n: n.path.index_hits)

    @property
    def bytes_by_path(self) -> dict[str, int]:
        """Payload bytes GETs received through shared memory ("shm") and over TCP ("tcp")."""
        return self._router.by_path(lambda n: n.bytes_by_path)

    @property
    def put_bytes_by_path(self) -> dict[str, int]:
        """Payload bytes PUTs stored through shared memory ("shm") and over TCP ("tcp")."""
        return self._router.by_path(lambda n: n.put_bytes_by_path)

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # -- single-key API -------------------------------------------------------------------

    async def put(self, key: Key, value: BufferOrSegments, *, ttl: float | None = None,
                  pin: bool = False, chunk_index: int = 0, num_tokens: int = 0,
                  fingerprint: bytes = ZERO_FINGERPRINT, parent: Key | None = None) -> None:
        """Store ``value``. Raises CapacityError if no owner has room even after eviction."""
        await self.put_many([key], [value], ttl=ttl, pin=pin, chunk_indexes=[chunk_index],
                            num_tokens=num_tokens, fingerprint=fingerprint,
                            parents=[parent] if parent is not None else None)

    async def get(self, key: Key) -> bytearray | None:
        """The payload as a new bytearray, or None on a miss (or a corrupt chunk)."""
        return (await self.get_many([key]))[0]

    async def get_into(self, key: Key, buffer: BufferOrSegments) -> int | None:
        """Receive the payload straight into ``buffer``; its length, or None on a miss."""
        return (await self.get_many_into([key], [buffer]))[0]

    async def exists(self, key: Key) -> bool:
        return (await self.exists_many([key]))[0]

    async def delete(self, key: Key) -> bool:
        """True if the key was present."""
        return (await self.delete_many([key]))[0]

    @traced("pin")
    async def pin(self, key: Key) -> bool:
        """Never evict this chunk (TTL still applies); False if absent. Idempotent."""
        return (await self._statuses(Op.PIN, key_bytes(key)))[0]

    @traced("unpin")
    async def unpin(self, key: Key) -> bool:
        return (await self._statuses(Op.UNPIN, key_bytes(key)))[0]

    # -- batch API ------------------------------------------------------------------------

    @traced("put_many")
    async def put_many(self, keys: Sequence[Key], values: Sequence[BufferOrSegments], *,
                       ttl: float | None = None, pin: bool = False,
                       chunk_indexes: Sequence[int] | None = None, num_tokens: int = 0,
                       fingerprint: bytes = ZERO_FINGERPRINT,
                       parents: Sequence[Key | None] | None = None) -> None:
        """Store several values, on ``replication`` nodes each in a cluster.

        ``chunk_indexes`` (default 0) is each chunk's depth in its prefix; the
        node evicts deeper chunks first at equal recency. ``parents`` (each
        chunk's previous chunk key, or None) only feed the nodes' KV events.
        Raises CapacityError naming the keys no node had room for (the others
        are stored).
        """
        bkeys, bparents, ttl_ms, flags = put_args(keys, values, ttl=ttl, pin=pin,
                                                  chunk_indexes=chunk_indexes,
                                                  num_tokens=num_tokens, parents=parents)
        await self.connect()
        refused, stored = await cluster_ops.put(self._router, cluster_ops.PutBatch(
            bkeys, values, ttl_ms, flags, chunk_indexes, num_tokens, fingerprint, bparents))
        raise_put_errors(bkeys, refused, stored)

    @traced("get_many")
    async def get_many(self, keys: Sequence[Key]) -> list[bytearray | None]:
        """Payloads as new bytearrays (None for misses), in key order."""
        return as_bytearrays(await self._get(join_keys(keys), None))

    @traced("get_many_into")
    async def get_many_into(self, keys: Sequence[Key], buffers: Sequence[BufferOrSegments]
                            ) -> list[int | None]:
        """Receive each payload into its buffer; lengths, None for misses.

        A buffer may be a list (or tuple) of buffers, filled in order as one
        (like ``readv``): the GPU client receives a chunk straight into the
        engine's KV blocks this way. Bytes of a payload that fails its
        checksum may have been written into the buffer; it is reported as a miss.
        """
        results = await self._get(join_keys(keys), get_sinks(keys, buffers))
        return [len(r) if r is not None else None for r in results]

    @property
    def router(self) -> Router:
        """The map this client routes by and a :class:`NodeClient` per node (what the sync
        facade's blocking routes share: ``client/_loop_free.py``)."""
        return self._router

    @property
    def records_spans(self) -> bool:
        """Whether calls record client spans now (an SDK tracer provider is installed)."""
        return tracer_for(self) is not None

    def read_in_place(self, key: Key, consume: Callable[[memoryview], None]) -> bool:
        """Hand ``consume`` the payload of ``key`` where it lies in a same-host node's
        memory, with no request and no copy (the GPU client scatters a chunk into CPU
        KV blocks from there); True once the payload hashed to its checksum before
        ``consume`` ran and its memory was not reused until it returned.

        False where it cannot: not a standalone same-host node read through its arena
        index, the key not in DRAM, client spans to record, or not x86-64. False also
        when the value was freed or replaced while ``consume`` ran: ``consume`` then
        read bytes of no value, and the caller must redo what it did with them from a
        copy it asks for (``get_into``). Runs ``consume`` in the calling thread; the
        read is reported to the node like other reads through the index."""
        node = self._router.standalone_node
        if node is None or not node.path.can_read_local or self.records_spans:
            return False
        return node.path.consume_local(key_bytes(key), consume)

    @property
    def can_read_in_place(self) -> bool:
        """Whether :meth:`read_in_place` may answer True now (a standalone same-host node
        whose arena index this client reads; no client spans to record)."""
        node = self._router.standalone_node
        return node is not None and node.path.can_read_local and not self.records_spans

    @traced("exists_many")
    async def exists_many(self, keys: Sequence[Key]) -> list[bool]:
        return list(map(bool, await self.exists_codes(join_keys(keys))))

    @traced("exists_tiers")
    async def exists_tiers(self, keys: Sequence[Key]) -> list[str | None]:
        """The tier ("dram", "ssd", "s3") holding each key, None where none does."""
        codes = await self.exists_codes(join_keys(keys))
        return tier_names(codes)

    @traced("delete_many")
    async def delete_many(self, keys: Sequence[Key]) -> list[bool]:
        return await self._statuses(Op.DELETE, join_keys(keys))

    async def lookup(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` (a prefix's chunk keys, in order) the pool holds."""
        return len(await self.lookup_tiers(keys))

    @traced("lookup")
    async def lookup_tiers(self, keys: Sequence[Key]) -> list[str]:
        """The tier ("dram", "ssd" or "s3") of each leading key held anywhere, in order.

        One round trip: against a cluster, every owner is asked in parallel.
        """
        await self.connect()
        codes = await cluster_ops.lookup(self._router, join_keys(keys))
        return cast(list[str], tier_names(codes))  # no zeros: the held prefix

    @traced("stats")
    async def stats(self) -> dict[str, Any]:
        """A standalone node's counters; for a cluster, ``{"epoch", "nodes": {id: counters}}``.

        Reads through the arena index not yet reported (TOUCH) are reported first, so the
        counters include every read this client made."""
        await self.connect()
        await asyncio.gather(*(node.path.touches.flush()
                               for node in self._router.nodes.values()))
        node = self._router.standalone_node
        if node is not None:
            return await node.json_op(Op.STATS)
        return {"epoch": self.epoch, "nodes": await cluster_ops.node_stats(self._router)}

    async def cluster_map(self) -> dict[str, Any]:
        """The map as a node serves it (a one-node map for a standalone node)."""
        await self.connect()
        return await cluster_ops.map_dict(self._router)

    # -- ops routed by the map ---------------------------------------------------------

    async def _get(self, blob: bytes, sinks: Sequence[memoryview | Segments] | None
                   ) -> list[memoryview | Segments | None]:
        await self.connect()
        return await cluster_ops.get(self._router, blob, sinks)

    @traced("exists_codes")
    async def exists_codes(self, keys: bytes | Sequence[Key]) -> bytes:
        """The fastest tier holding each key as a ``Tier`` code, 0 where none does.

        ``keys`` may be one blob of 16-byte keys. (The raw form of ``exists_tiers``.)
        """
        blob = keys if isinstance(keys, bytes) else join_keys(keys)
        await self.connect()
        return await cluster_ops.exists_codes(self._router, blob)

    async def _statuses(self, op: Op, blob: bytes) -> list[bool]:
        """DELETE/PIN/UNPIN: True where some node did it."""
        await self.connect()
        return await cluster_ops.statuses(self._router, op, blob)


class PutArgs(NamedTuple):
    bkeys: list[bytes]
    bparents: list[bytes | None] | None
    ttl_ms: int
    flags: int


def put_args(keys: Sequence[Key], values: Sequence[BufferOrSegments], *, ttl: float | None,
             pin: bool, chunk_indexes: Sequence[int] | None, num_tokens: int,
             parents: Sequence[Key | None] | None) -> PutArgs:
    """A put's arguments checked (ValueError, InvalidKeyError, InvalidArgumentError) and
    in wire form."""
    if len(keys) != len(values):
        raise ValueError("put_many needs as many values as keys")
    if chunk_indexes is not None and len(chunk_indexes) != len(keys):
        raise ValueError("put_many needs one chunk index per key")
    if parents is not None and len(parents) != len(keys):
        raise ValueError("put_many needs one parent (or None) per key")
    check_u32("num_tokens", num_tokens)
    for index in chunk_indexes or ():
        check_u32("chunk_index", index)
    bparents = [key_bytes(p) if p is not None else None for p in parents] \
        if parents is not None else None
    return PutArgs([key_bytes(k) for k in keys], bparents, ttl_ms_of(ttl),
                   PUT_FLAG_PIN if pin else 0)


def raise_put_errors(bkeys: Sequence[bytes], statuses: Sequence[int],
                     stored: Sequence[bool]) -> None:
    """CapacityError or NotDurableError for the values of a put no node stored (the others
    are stored), or the error of another refusal."""
    failed: list[bytes] = []
    not_durable: list[bytes] = []
    for key, status, ok in zip(bkeys, statuses, stored, strict=True):
        if ok:
            continue
        if status == Status.NO_CAPACITY:
            failed.append(key)
        elif status == Status.UNAVAILABLE:
            not_durable.append(key)
        else:
            raise error_for_status(status, f"PUT of {key.hex()} refused")
    if not_durable:
        raise NotDurableError(
            f"{len(not_durable)} of {len(bkeys)} values are cached but not in S3 (the node "
            f"runs write-through): {', '.join(k.hex() for k in not_durable[:4])}")
    if failed:
        raise CapacityError(f"no room for {len(failed)} of {len(bkeys)} values "
                            "(everything left is pinned or being read)", failed)
