"""The admin port's listener: a connection cap, and descriptors kept for the data port.

aiohttp serves the admin API (``server/admin/api.py``) with no bound on its connections: a
flood of idle connections to the admin port once took every descriptor of the process,
and tenants' data connections were closed at accept. :class:`CappedSite` serves at most
``max_connections`` at once (a connection past that is closed as it is accepted), and
the runner closes one that sends no request for ``admin_idle_timeout_s`` (aiohttp's
keep-alive timer, which also runs from accept). :func:`reserve_descriptors` raises the
process's descriptor limit to what both ports' caps need, where the hard limit allows,
and says so where it does not.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import ssl
import weakref

from aiohttp import web

__all__ = ["SPARE_DESCRIPTORS", "CappedSite", "reserve_descriptors"]

log = logging.getLogger("kvpool.server")

#: descriptors kept beyond both ports' caps: RocksDB's files, the worker's socket, the
#: arena, logs, peers' connections, the lookup parser's pipes
SPARE_DESCRIPTORS = 256


def reserve_descriptors(data_connections: int, admin_connections: int) -> int:
    """Raise the soft descriptor limit (RLIMIT_NOFILE) to what ``data_connections`` and
    ``admin_connections`` need, plus :data:`SPARE_DESCRIPTORS`, as far as the hard limit
    allows; the soft limit in force after. A warning names the shortfall, if any: the
    admin cap still holds, so only data connections past the limit can be refused."""
    needed = data_connections + admin_connections + SPARE_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the descriptor limit to %d: %s", target, exc)
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning("the descriptor limit is %d: fewer than --max-connections %d, "
                    "--admin-max-connections %d and %d spare need; about %d data connections "
                    "fit (raise the hard limit: ulimit -n, or the service's LimitNOFILE)",
                    soft, data_connections, admin_connections, SPARE_DESCRIPTORS,
                    max(0, soft - admin_connections - SPARE_DESCRIPTORS))
    return int(soft)


class _Refused(asyncio.Protocol):
    """A connection past the cap: closed as soon as it is accepted."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.abort()  # type: ignore[attr-defined]  # (a Transport: it has abort)


class _Counted(asyncio.Protocol):
    """aiohttp's handler for one connection, counted from accept until it is lost, or,
    over TLS, until it is dropped unused (a handshake that failed: asyncio then never
    calls ``connection_lost``, and the protocol is garbage)."""

    def __init__(self, site: CappedSite, inner: asyncio.Protocol) -> None:
        self._site = site
        self._inner = inner
        self._counted = [True]  # shared with the finalizer, which must not hold self
        site.open_connections += 1
        weakref.finalize(self, site.release, self._counted)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._inner.connection_lost(exc)
        self._site.release(self._counted)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class CappedSite(web.BaseSite):
    """aiohttp's ``SockSite`` with at most ``max_connections`` open at once."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, *,
                 max_connections: int, ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._sock = sock
        self._max_connections = max_connections
        #: connections open now, and those refused since start
        self.open_connections = 0
        self.refused = 0

    def release(self, counted: list[bool]) -> None:
        """A counted connection is gone (once, whichever of its ends comes first)."""
        if counted[0]:
            counted[0] = False
            self.open_connections -= 1

    @property
    def name(self) -> str:
        host, port = self._sock.getsockname()[:2]
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{host}:{port}"

    async def start(self) -> None:
        await super().start()
        self._server = await asyncio.get_running_loop().create_server(
            self._protocol, sock=self._sock, ssl=self._ssl_context, backlog=self._backlog)

    def _protocol(self) -> asyncio.Protocol:
        if self.open_connections >= self._max_connections:
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                log.warning("admin port: %d connections open (--admin-max-connections): "
                            "refused %d so far", self.open_connections, self.refused)
            return _Refused()
        server = self._runner.server
        assert server is not None  # set up before the site starts
        return _Counted(self, server())
