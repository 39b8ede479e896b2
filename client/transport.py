"""How a client reaches a node: the :class:`Transport` seam, over TCP or in process.

A :class:`~kvpool.client._node.NodeClient` asks its transport for each pooled
connection. Whatever the transport, the connection is the same
:class:`~kvpool.client._connection.Connection` (framing, pipelining, deadlines,
payloads checksummed as they arrive); the transport only carries its bytes.

- :class:`TcpTransport` (the default): a socket to ``host:port``, TLS where the
  client has an ``ssl`` context.
- :class:`MockTransport`: no socket and no node; each request frame, parsed as a
  node parses it, goes to a handler function that returns the reply frame. Unit
  tests of the SDK's routing logic (failover, map refresh, batching, corrupt-chunk
  handling) run on it in milliseconds; httpx's ``MockTransport`` is the model.
  The sync client's loop-free paths (a blocking socket, the arena index) are off
  with it: every call runs on the loop, through the handler.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from kvpool.client._connection import Buffer, Connection
from kvpool.protocol.errors import KvpoolConnectionError, KvpoolTimeoutError
from kvpool.protocol.parsers import Request, RequestParser

if TYPE_CHECKING:
    from kvpool.client._options import ClientOptions

__all__ = ["MockHandler", "MockTransport", "TcpTransport", "Transport"]


class Transport(Protocol):
    """Opens a connection to a node (``make`` builds the client's end of it)."""

    async def open(self, host: str, port: int, options: ClientOptions,
                   make: Callable[[], Connection]) -> Connection:
        """The connection, ready for HELLO; KvpoolConnectionError (or its timeout
        subclass) when the node cannot be reached."""
        ...


class TcpTransport:
    """A TCP socket per connection (TLS with ``options.ssl``)."""

    async def open(self, host: str, port: int, options: ClientOptions,
                   make: Callable[[], Connection]) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(options.connect_timeout):
                _, conn = await loop.create_connection(make, host, port, ssl=options.ssl)
        except TimeoutError:
            raise KvpoolTimeoutError(
                f"connecting to {host}:{port} took longer than {options.connect_timeout}s"
            ) from None
        except OSError as exc:  # ssl.SSLError included
            raise KvpoolConnectionError(
                f"cannot connect to kvpool node {host}:{port}: {exc}") from exc
        return conn


#: ``handler(address, request)``: the reply frame's buffers (``encode_frame``,
#: ``encode_error`` of :mod:`kvpool.protocol.frames`), or None for no reply ever (the
#: client's deadline runs out). Raising OSError ends the connection with that error.
MockHandler = Callable[[str, Request], "Iterable[Buffer] | None"]


class MockTransport:
    """Connections answered by ``handler`` in this process (see the module docstring).

    ``address`` is ``"host:port"`` as the client dialled it. Addresses in :attr:`down`
    refuse connections; :meth:`drop` ends the open ones of an address.
    """

    def __init__(self, handler: MockHandler) -> None:
        self.handler = handler
        #: addresses that refuse new connections
        self.down: set[str] = set()
        self._open: dict[str, list[_MockSocket]] = {}

    async def open(self, host: str, port: int, options: ClientOptions,
                   make: Callable[[], Connection]) -> Connection:
        address = f"{host}:{port}"
        if address in self.down:
            raise KvpoolConnectionError(
                f"cannot connect to kvpool node {address}: connection refused (mock)")
        conn = make()
        sock = _MockSocket(self, address, conn)
        self._open.setdefault(address, []).append(sock)
        conn.connection_made(sock)  # type: ignore[arg-type]  # the calls Connection makes
        return conn

    def drop(self, address: str) -> None:
        """End every open connection to ``address`` (as a node that exits does)."""
        for sock in self._open.pop(address, []):
            sock.lose(None)


class _MockSocket:
    """The asyncio transport a :class:`Connection` writes to: request frames are
    parsed as a node parses them and handed to the handler; its reply is fed back."""

    def __init__(self, owner: MockTransport, address: str, conn: Connection) -> None:
        self._owner = owner
        self._address = address
        self._conn = conn
        self._parser = RequestParser()
        self._closed = False

    def writelines(self, parts: Iterable[Buffer]) -> None:
        for part in parts:
            self.write(part)

    def write(self, data: Buffer) -> None:
        if self._closed:
            return
        for request in self._parser.feed(bytes(data)):
            try:
                reply = self._owner.handler(self._address, request)
            except OSError as exc:
                asyncio.get_running_loop().call_soon(self.lose, exc)
                return
            finally:
                request.release()
            if reply is not None:
                asyncio.get_running_loop().call_soon(self._deliver, b"".join(reply))

    def _deliver(self, data: bytes) -> None:
        view = memoryview(data)
        while view.nbytes and not self._closed:
            buffer = self._conn.get_buffer(view.nbytes)
            n = min(buffer.nbytes, view.nbytes)
            buffer[:n] = view[:n]
            self._conn.buffer_updated(n)
            view = view[n:]

    def lose(self, exc: Exception | None) -> None:
        if not self._closed:
            self._closed = True
            self._conn.connection_lost(exc)

    def close(self) -> None:
        self.lose(None)

    def abort(self) -> None:
        self.lose(None)

    def is_closing(self) -> bool:
        return self._closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": self._address}.get(name, default)
