"""The same-host fast path: co-located clients read values straight from the DRAM arena.

How a client gets in:

1. In HELLO it says ``"shm": true`` and its host's boot id. On the same host
   (same boot id) the node answers with ``"shm": {"socket", "ticket", ...}``:
   an abstract Unix socket (no file to leak; reachable only from this
   network namespace) and a one-time ticket naming this data connection.
2. The client connects to that socket and sends the ticket. The node reads
   the peer's credentials from the kernel (``SO_PEERCRED``) and, if that
   user may map the arena (the node's own user, or those ``--shm-allow``
   names), marks the connection granted and passes it a **read-only** file
   descriptor of the arena's memory file (``SCM_RIGHTS``). Otherwise it
   answers ``NO`` and the client keeps using TCP.
3. On a granted connection ``GET_SHM`` replies with (offset, length,
   generation) per value under a *lease*: the node holds those entries (not
   evicted, their memory not reused) until the client sends ``RELEASE``, the
   connection closes, or ``lease_s`` passes -- eviction never waits on a slow
   or dead reader for longer. The client copies from its mapping, verifies
   the envelope checksum and re-reads the generation (see ``tiers/arena.py``,
   and ``docs/protocol.md`` for the order): a value freed mid-copy is never
   returned torn.
   With the arena it also passes (to a connection whose keys carry no tenant
   scope) a read-only descriptor of the *arena index* (``tiers/arena_index.py``,
   layout in ``protocol/shm_index.py``): where each DRAM value lies, so the
   client reads most values with no request and no lease, checking them the
   same way, and reports them afterwards with ``TOUCH`` (hits, bytes, recency).
4. PUT the other way: a client of the node's **own user** gets a writable
   descriptor instead (unless the node runs with ``--no-shm-write``) -- with
   tenants configured, only an admin token's: a writer could plant a value
   with a valid checksum in another tenant's chunk.

Who gets a mapping at all: open mode and admin tokens. A non-admin tenant is
never offered one (it reads over TCP): the arena holds every tenant's chunks,
and a process of the node's own user *owns* the memory file, so it could
``fchmod`` a read-only descriptor and reopen it (``/proc/self/fd/N``) for
writing. With a tokens file the node also makes itself non-dumpable
(``PR_SET_DUMPABLE`` 0), so a process of its user cannot reach the arena
through ``/proc/<node>/fd``, ``/proc/<node>/mem`` or ptrace either. For
another user (``--shm-allow``) a read-only descriptor stays read-only: the
files are mode 0600 and the node's (no reopening for writing), the arena's
size is sealed, and the index refuses every new writable mapping
(``F_SEAL_FUTURE_WRITE``). Root can still write the arena: it can write any
process's memory. ``PUT_SHM`` reserves arena slots under
   a lease and says where they are; the client writes each envelope and
   payload there and sends ``COMMIT``, which publishes them as a PUT would.
   A slot stays invisible to readers until then; a lease not committed by
   its deadline (or whose connection closes) gives its slots back, and a late
   COMMIT stores nothing. Readers verify every value's checksum, so a client
   that writes outside its slots can make chunks unreadable (dropped as
   corrupt), never returned wrong.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import socket
import struct
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvpool.protocol.errors import ConfigError
from kvpool.protocol.host import host_id
from kvpool.protocol.parsers import PutItem, release_items
from kvpool.server.data.session import Session
from kvpool.tiers.arena_index import ArenaIndex
from kvpool.tiers.dram import DramTier, Entry

__all__ = ["Lease", "ShmService", "parse_allow"]

log = logging.getLogger("kvpool.server.data.shm")

_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
#: a ticket not redeemed within this many seconds is dropped
TICKET_TTL_S = 30.0


def parse_allow(text: str) -> tuple[frozenset[int], frozenset[int]]:
    """``"uid:1000,gid:27"`` -> (uids, gids); '' -> the node's own user only."""
    uids: set[int] = set()
    gids: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, value = part.partition(":")
        if kind not in ("uid", "gid") or not value.isdigit():
            raise ConfigError(f"shm_allow: {part!r} is not uid:N or gid:N")
        (uids if kind == "uid" else gids).add(int(value))
    if not uids and not gids:
        uids.add(os.geteuid())
    return frozenset(uids), frozenset(gids)


@dataclass(slots=True, eq=False)
class Lease:
    """Values a client reads (``entries``), or slots it writes (``items``, PUT_SHM)."""

    entries: list[Entry]
    deadline: float
    session: Session
    items: list[PutItem] | None = None


@dataclass(slots=True)
class ShmCounters:
    grants: int = 0
    denied: int = 0
    leases: int = 0
    released: int = 0
    expired: int = 0
    bytes_out: int = 0
    items_out: int = 0
    #: values clients read through the arena index (no GET_SHM), as their TOUCH reported
    index_bytes_out: int = 0
    index_items_out: int = 0
    #: writable grants (the node's own user), PUT_SHM leases, and what COMMIT stored
    write_grants: int = 0
    put_leases: int = 0
    committed: int = 0
    bytes_in: int = 0


class ShmService:
    """Grants the arena to co-located clients and keeps their leases."""

    def __init__(self, dram: DramTier, *, lease_s: float, allow: str = "",
                 write: bool = True) -> None:
        if lease_s <= 0:
            raise ConfigError("shm_lease_s must be > 0")
        self.dram = dram
        self.lease_s = lease_s
        #: whether clients of the node's own user get a writable mapping (PUT_SHM)
        self.write = write
        self.uids, self.gids = parse_allow(allow)
        self.host = host_id()
        self.name = f"kvpool-shm-{os.getpid()}-{secrets.token_hex(6)}"
        self.counters = ShmCounters()
        self._tickets: dict[str, tuple[Session, float]] = {}
        self._leases: dict[int, Lease] = {}
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._ro_fd = -1
        self.index: ArenaIndex | None = None
        self._index_fd = -1
        self._granting: set[asyncio.Task[None]] = set()

    @property
    def open_leases(self) -> int:
        return len(self._leases)

    def stats(self) -> dict[str, Any]:
        """The fast path's counters (GET /v1/stats "shm")."""
        index = self.index
        return {"socket": self.name, "lease_s": self.lease_s, "open_leases": self.open_leases,
                **asdict(self.counters),
                "index": {} if index is None else {
                    "entries": len(index), "sets": index.sets, **asdict(index.counters)}}

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        # a read-only descriptor of the arena's memory file: clients can map it, never write
        self._ro_fd = os.open(f"/proc/self/fd/{self.dram.arena.fd}", os.O_RDONLY | os.O_CLOEXEC)
        self.index = ArenaIndex(self.dram.arena.capacity)
        self._index_fd = os.open(f"/proc/self/fd/{self.index.fd}", os.O_RDONLY | os.O_CLOEXEC)
        self.dram.attach_index(self.index)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind("\0" + self.name)
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        self._task = asyncio.create_task(self._accept_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sock is not None:
            self._sock.close()
        for lease_id in list(self._leases):
            self._end(lease_id)
        if self._ro_fd >= 0:
            os.close(self._ro_fd)
            self._ro_fd = -1
        if self.index is not None:
            self.index.retire()
        if self._index_fd >= 0:  # the index itself is the DRAM tier's now: closed with it
            os.close(self._index_fd)
            self._index_fd = -1

    # -- granting -------------------------------------------------------------------------

    def offer(self, session: Session, hello: dict[str, object]) -> dict[str, object] | None:
        """What HELLO answers a client that asked for the fast path (None: not offered;
        ``{"refused": why}``: not to this client)."""
        if hello.get("shm") is not True or not self.host or hello.get("host") != self.host:
            return None
        if not session.any_uid:  # a non-admin tenant: see the module doc
            self.counters.denied += 1
            return {"refused": "a tenant's token reads over TCP: only admin tokens may map "
                               "the arena, which holds every tenant's chunks"}
        now = time.monotonic()
        for ticket, (_, expires) in list(self._tickets.items()):
            if expires < now:
                del self._tickets[ticket]
        ticket = secrets.token_hex(16)
        self._tickets[ticket] = (session, now + TICKET_TTL_S)
        arena = self.dram.arena
        offer: dict[str, object] = {
            "socket": self.name, "ticket": ticket, "capacity": arena.capacity,
            "file_size": arena.file_size(arena.capacity), "lease_s": self.lease_s,
            "commit_as": True}  # this node takes COMMIT_AS (older ones: PUT_SHM and COMMIT)
        # the index holds stored keys; a tenant's are scoped, so it looks its own up by GET_SHM
        session.index = self.index is not None and session.principal.tenant is None
        if session.index and self.index is not None:
            offer["index_size"] = self.index.file_size
        return offer

    def allowed(self, uid: int, gid: int) -> bool:
        return uid in self.uids or gid in self.gids

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            task = loop.create_task(self._grant(conn))
            self._granting.add(task)
            task.add_done_callback(self._granting.discard)

    async def _grant(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            conn.setblocking(False)
            try:
                async with asyncio.timeout(5):
                    ticket = (await loop.sock_recv(conn, 64)).decode("ascii", "replace")
            except (TimeoutError, OSError):
                return
            pid, uid, gid = _CREDS.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
            found = self._tickets.pop(ticket.strip(), None)
            fds: list[int] = []
            if found is None:
                answer = b"NO unknown or expired ticket"
            elif not self.allowed(uid, gid) or not found[0].any_uid:
                self.counters.denied += 1
                log.info("shared-memory fast path refused to pid %d (uid %d gid %d)", pid, uid,
                         gid)
                answer = b"NO this user may not map the arena"
            elif self.write and uid == os.getuid() and found[0].any_uid:
                # writes only for the node's own uid, and with tenants only for admins: a
                # writer could plant a value with a valid checksum in another tenant's chunk
                found[0].shm = found[0].write = True
                self.counters.grants += 1
                self.counters.write_grants += 1
                answer, fds = b"OK rw", [self.dram.arena.fd]
            else:
                found[0].shm = True
                self.counters.grants += 1
                answer, fds = b"OK", [self._ro_fd]
            if fds and found is not None and found[0].index:
                fds.append(self._index_fd)  # read-only for every client
            # a few bytes into an empty socket buffer: this send does not block
            with contextlib.suppress(OSError):
                conn.sendmsg([answer], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                         array.array("i", fds))] if fds else [])

    # -- leases ---------------------------------------------------------------------------

    def lease(self, session: Session, entries: list[Entry]) -> int:
        """Keep ``entries`` (already held by the caller) until released or expired."""
        self.counters.leases += 1
        return self._open(Lease(entries, time.monotonic() + self.lease_s, session))

    def reserve(self, session: Session, items: list[PutItem]) -> int:
        """Hold PUT_SHM slots (``items``' reservations) for the client to write into."""
        self.counters.put_leases += 1
        return self._open(Lease([], time.monotonic() + self.lease_s, session, items))

    def _open(self, lease: Lease) -> int:
        lease_id = next(self._ids)
        self._leases[lease_id] = lease
        lease.session.leases.add(lease_id)
        return lease_id

    def take(self, session: Session, lease_id: int) -> list[PutItem] | None:
        """The slots of ``session``'s PUT_SHM lease, now the caller's (None: expired)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.session is not session or lease.items is None:
            return None
        del self._leases[lease_id]  # not _end: the slots are the caller's now
        session.leases.discard(lease_id)
        return lease.items

    def release(self, session: Session, ids: list[int]) -> list[bool]:
        """End the given leases of ``session`` (a PUT_SHM lease's slots are given back
        unwritten); False for one that had expired (or is not its)."""
        done = []
        for lease_id in ids:
            lease = self._leases.get(lease_id)
            if lease is None or lease.session is not session:
                done.append(False)
                continue
            self._end(lease_id)
            self.counters.released += 1
            done.append(True)
        return done

    def expire(self) -> int:
        """End leases past their deadline (their readers are slow or gone)."""
        now = time.monotonic()
        late = [i for i, lease in self._leases.items() if lease.deadline <= now]
        for lease_id in late:
            self._end(lease_id)
        self.counters.expired += len(late)
        return len(late)

    def close_session(self, session: Session) -> None:
        """The connection closed: its leases end now."""
        for lease_id in list(session.leases):
            self._end(lease_id)

    def _end(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        lease.session.leases.discard(lease_id)
        for entry in lease.entries:
            self.dram.release(entry)
        release_items(lease.items or ())
