"""The seam for one-sided transports: how one node's GETs and puts travel past HELLO.

A node may grant a client a region of its memory at HELLO (today: its DRAM arena, to a
client on the same host). A one-sided transport reads and writes that region without
the node handling each byte (shared memory here; RDMA, UCX or NIXL across hosts would
be the next), and owns its fallback to the two-sided path, the op plans over the node's
connection (``kvpool.client._plans``), for whatever the region cannot carry.

Each :class:`~kvpool.client._node.NodeClient` holds one :class:`NodePath`, made when
the node client is: by the transport's :meth:`OneSidedTransport.one_sided` where the
transport has one, else the same-host arena path
(:class:`kvpool.client._shm_path.ShmPath`, which carries nothing until a node on this
host grants its arena). The async core and the sync facade's loop-free routes ask the
path, never a transport by name. A second implementation lives in the tests
(``tests/client/test_one_sided.py``: a path over the mock transport's in-process nodes,
one module).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from kvpool.client import _plans as plans
from kvpool.client._connection import Connection
from kvpool.client._shm_put import AheadHolder, ArenaHost
from kvpool.protocol.parsers import Segments

__all__ = ["BlockingGets", "NoRequestReads", "NodePath", "OneSidedTransport"]

Payloads = list[memoryview | Segments | None]


class NoRequestReads(Protocol):
    """Reads a path made with no request (through an index the node publishes), not yet
    reported to the node (it counts them as hits and uses)."""

    @property
    def due(self) -> bool:
        """Reads wait that should be reported before the next read with no request."""
        ...

    def later(self, conn: Connection | None = None) -> None:
        """Report them soon (on the loop), in one frame for many calls."""

    async def flush(self) -> None:
        """Report them now."""

    def close(self) -> None: ...


class BlockingGets(Protocol):
    """A blocking link to a node, as the sync client's thread uses it
    (``client/_blocking.py`` ``BlockingNode``)."""

    def get(self, blob: bytes, sinks: Sequence[memoryview | Segments] | None) -> Payloads:
        """The keys' payloads over the link (None: misses)."""
        ...


class NodePath(Protocol):
    """One node's GETs and puts: through the region it granted where that carries them,
    else over the node's connection by the op plans."""

    @property
    def touches(self) -> NoRequestReads:
        """Reads with no request not yet reported."""
        ...

    #: values read through the region but freed or replaced meanwhile (asked again)
    shm_torn: int
    #: values read with no request
    index_hits: int

    @property
    def asks_grant(self) -> bool:
        """Whether HELLO asks the node for a region (``plans.hello(arena=...)``)."""
        ...

    async def redeem(self, info: dict[str, Any], conn: Connection) -> None:
        """Take up what a HELLO answer (``info``, checked) offered on ``conn``; raise
        KvpoolConnectionError where the client requires the region and gets none."""

    @property
    def grant(self) -> object | None:
        """The region granted now (compared by identity: a new one after the node
        restarted), or None: everything goes over the connection."""
        ...

    @property
    def writable(self) -> bool:
        """The region granted now takes this client's puts."""
        ...

    def link_grant(self, info: dict[str, Any]) -> bool:
        """A blocking link's own HELLO answer (the sync facade's link asks a grant of its
        own, for its session): take up its offer; whether the link may write."""
        ...

    @property
    def carries_gets(self) -> bool:
        """Whether GETs go through the region (else over the connection)."""
        ...

    def carries_put(self, items: Sequence[plans.PutItem]) -> bool:
        """Whether a put of ``items`` goes through the region."""
        ...

    async def get(self, conn: Connection, blob: bytes,
                  sinks: Sequence[memoryview | Segments] | None) -> Payloads:
        """Payload views of the keys ``blob`` (None for misses and corrupt chunks)."""
        ...

    async def put(self, conn: Connection, items: list[plans.PutItem], *, num_tokens: int,
                  fingerprint: bytes) -> list[int]:
        """One Status per item."""
        ...

    def put_plan(self, holder: AheadHolder, items: list[plans.PutItem], *, num_tokens: int,
                 fingerprint: bytes) -> plans.Plan[list[int]]:
        """:meth:`put` as a plan ``holder`` (the connection it runs on) drives: the sync
        facade runs it on its blocking link."""
        ...

    @property
    def can_read_local(self) -> bool:
        """Whether the region may be read with no request now (:meth:`get_here`,
        :meth:`consume_local`)."""
        ...

    def get_here(self, blob: bytes, sinks: Sequence[memoryview | Segments] | None,
                 link: BlockingGets | None, before_read: Callable[[], bool]
                 ) -> Payloads | None:
        """A GET in the caller's thread with no event loop: what the region has, with no
        request, and the rest on ``link`` (the caller's blocking link to the node; None:
        it may use none). None, having sent nothing, where the GET must run on the loop.
        ``before_read`` runs before the region is read with no request (the sync client
        runs its loop then, now and again, and says so: it may have heard of a node
        gone)."""
        ...

    def consume_local(self, key: bytes, fn: Callable[[memoryview], None]) -> bool:
        """Hand ``fn`` the payload where it lies, with no copy; True once it was whole."""
        ...

    def release(self) -> None:
        """Give up the region (the node went away, or left the map)."""

    def close(self) -> None:
        """The node client closes its connections (reads with no request still to report
        go first, when a loop runs)."""


@runtime_checkable
class OneSidedTransport(Protocol):
    """A transport (``kvpool.client.transport.Transport``) with a one-sided path of its
    own: each node client's :class:`NodePath` comes from it."""

    def one_sided(self, node: ArenaHost) -> NodePath: ...
