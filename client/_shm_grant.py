"""What a same-host node granted this client at HELLO: its arena, mapped
(:class:`ArenaGrant`, the grant half of :class:`kvpool.client._shm_path.ShmPath`).

HELLO asks for the arena; a node on this host that allows this client answers with an
offer (a Unix socket and a ticket), which is traded for the arena's descriptors (and
its index's) and mapped. A blocking link of the sync client asks a grant of its own,
for its session; a restarted node's new arena replaces the mapping.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from kvpool.client import _plans as plans
from kvpool.client._connection import Connection
from kvpool.client._shm import ShmMapping, redeem
from kvpool.client._shm_put import ArenaHost
from kvpool.protocol.errors import KvpoolConnectionError

__all__ = ["ArenaGrant"]

log = logging.getLogger("kvpool.client")


class ArenaGrant:
    """One node's arena as this client mapped it (:attr:`mapping`; None: TCP only)."""

    def __init__(self, node: ArenaHost) -> None:
        self.node = node
        #: the arena the node granted (None: TCP only, so far)
        self.mapping: ShmMapping | None = None

    def release(self) -> None:
        """Unmap the arena (the node went away, or left the map)."""
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None

    @property
    def asks_grant(self) -> bool:
        """HELLO asks for the arena unless ``shm=False``, or connections are not TCP (a
        mock transport's)."""
        options = self.node.options
        return options.shm is not False and options.over_tcp

    @property
    def grant(self) -> ShmMapping | None:
        """The arena mapped now (None: TCP only, so far)."""
        return self.mapping

    async def redeem(self, info: dict[str, Any], conn: Connection) -> None:
        """Map the arena a HELLO answer offered, for ``conn``'s session (its descriptors
        over the node's Unix socket, in a thread: the node may share this event loop, as
        a node's own peer client does). ``shm=True``: KvpoolConnectionError where the
        node offers none, or refuses the ticket; else those go over TCP."""
        options = self.node.options
        offer = plans.arena_offer(info)
        if offer is None:
            if options.shm:
                offered = info.get("shm")
                refused = offered.get("refused") if isinstance(offered, dict) else None
                raise KvpoolConnectionError(
                    f"node {self.node.node_id} offers no shared-memory fast path: "
                    + (str(refused) if refused else "another host, or started with --no-shm"))
            return
        try:
            fd, index_fd, writable = await asyncio.get_running_loop().run_in_executor(
                None, redeem, offer, options.connect_timeout)
        except KvpoolConnectionError as exc:
            if options.shm:
                raise
            log.info("%s: using TCP: %s", self.node.node_id, exc)
            return
        self.adopt(offer, fd, index_fd, writable)
        conn.shm = True
        conn.shm_write = writable

    @property
    def writable(self) -> bool:
        """The arena mapped now takes this client's puts (a client of the node's user)."""
        return self.mapping is not None and self.mapping.writable

    def link_grant(self, info: dict[str, Any]) -> bool:
        """A blocking link's HELLO answer: map the arena it offered (in this thread);
        whether the link may write it. False where none was offered, or it was refused
        (the link's puts go over TCP)."""
        offer = plans.arena_offer(info)
        if offer is None:
            return False
        try:
            fd, index_fd, writable = redeem(offer, self.node.options.connect_timeout)
        except KvpoolConnectionError as exc:
            log.info("%s: blocking puts go over TCP: %s", self.node.node_id, exc)
            return False
        self.adopt(offer, fd, index_fd, writable)
        return writable

    def adopt(self, offer: dict[str, Any], fd: int, index_fd: int, writable: bool) -> None:
        """The arena an offer named, redeemed (``fd``, ``index_fd``): mapped, unless it is
        the one mapped already (the descriptors are then closed). A restarted node has a
        new arena; a changed grant, another mapping."""
        mapping = self.mapping
        if mapping is None or mapping.socket != offer["socket"] or mapping.writable != writable:
            self.release()
            self.mapping = ShmMapping(fd, offer, writable=writable, index_fd=index_fd)
            return
        os.close(fd)
        if index_fd >= 0:
            os.close(index_fd)
