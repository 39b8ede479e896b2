"""How a client reaches a node: the :class:`Transport` seam, over TCP or in process.

A :class:`~kvpool.client._node.NodeClient` asks its transport for each pooled
connection. Whatever the transport, the connection is the same
:class:`~kvpool.client._connection.Connection` (framing, pipelining, deadlines,
payloads checksummed as they arrive); the transport only carries its bytes. The sync
client's loop-free calls ask it for a blocking connection (:meth:`Transport.open_blocking`,
a :class:`BlockingLink`: one request, then its reply, in the calling thread).

- :class:`TcpTransport` (the default): a socket to ``host:port``, TLS where the
  client has an ``ssl`` context; for the sync client, a blocking socket of its own
  (:class:`~kvpool.client._socket.BlockingConnection`).
- :class:`MockTransport`: no socket and no node; each request frame, parsed as a
  node parses it, goes to a handler function that returns the reply frame. Unit
  tests of the SDK's routing logic (failover, map refresh, batching, corrupt-chunk
  handling) run on it in milliseconds; httpx's ``MockTransport`` is the model.
  The sync client's blocking calls reach the same handler in the calling thread (a
  reply never given is a timeout at once). The same-host fast path is off with it.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from kvpool.client._connection import Buffer, Connection, request_head
from kvpool.client._plans import Sink
from kvpool.client._socket import BlockingConnection, stray_reply
from kvpool.protocol.errors import (
    BadFrameError,
    BadReplyError,
    KvpoolConnectionError,
    KvpoolError,
    KvpoolTimeoutError,
)
from kvpool.protocol.frames import Op
from kvpool.protocol.parsers import (
    Reply,
    ReplyParser,
    Request,
    RequestParser,
    reply_mismatch,
)

__all__ = ["BlockingLink", "LinkOptions", "MockHandler", "MockTransport", "TcpTransport",
           "Transport"]


class LinkOptions(Protocol):
    """What a transport reads of the client's options (a ``ClientOptions``; named here
    so the options, which default to TCP, and the transports do not import each
    other)."""

    @property
    def timeout(self) -> float: ...

    @property
    def connect_timeout(self) -> float: ...

    @property
    def ssl(self) -> ssl.SSLContext | None: ...

    @property
    def scope_flags(self) -> int: ...

    @property
    def busy_poll_us(self) -> float: ...


class BlockingLink(Protocol):
    """A blocking connection to a node: one request at a time, in the calling thread."""

    def call(self, op: int, count: int, body: Sequence[Buffer],
             sinks: Sequence[Sink | None] | None = None, *, epoch: int = 0) -> Reply:
        """Send one request frame and return its reply, any status (the caller checks);
        KvpoolConnectionError (or its timeout subclass), after which the link is closed."""
        ...

    def begin(self, op: int, count: int, body: Sequence[Buffer],
              sinks: Sequence[Sink | None] | None = None, *, epoch: int = 0) -> None:
        """:meth:`call`'s first half: send the frame (errors as :meth:`call`'s)."""
        ...

    def finish(self) -> Reply:
        """:meth:`call`'s second half: the reply to the frame :meth:`begin` sent."""
        ...

    def stale(self, idle_s: float) -> bool:
        """Whether it should not carry another request (closed, ended by the node, or
        idle for most of the node's idle timeout ``idle_s``)."""
        ...

    def fileno(self) -> int:
        """The socket's descriptor, to wait on it with others (readable: a reply is
        arriving); -1 where there is none to wait on (the reply is there at once)."""
        ...

    def close(self) -> None:
        ...

    def limit_values(self, max_value_bytes: int) -> None:
        """GET values received into buffers of the link's own are at most this large (the
        node's ``max_value_bytes``, from its checked HELLO)."""
        ...


class Transport(Protocol):
    """Opens connections to a node: pooled ones for the async core (``make`` builds the
    client's end), and a blocking one for the sync client's loop-free calls."""

    async def open(self, host: str, port: int, options: LinkOptions,
                   make: Callable[[], Connection]) -> Connection:
        """The connection, ready for HELLO; KvpoolConnectionError (or its timeout
        subclass) when the node cannot be reached."""
        ...

    def open_blocking(self, host: str, port: int, options: LinkOptions) -> BlockingLink:
        """A blocking connection, ready for HELLO; errors as :meth:`open`'s."""
        ...


class TcpTransport:
    """A TCP socket per connection (TLS with ``options.ssl``)."""

    def open_blocking(self, host: str, port: int, options: LinkOptions) -> BlockingLink:
        return BlockingConnection(host, port, timeout=options.timeout,
                                  connect_timeout=options.connect_timeout, ssl=options.ssl,
                                  scope_flags=options.scope_flags,
                                  busy_poll_us=options.busy_poll_us)

    async def open(self, host: str, port: int, options: LinkOptions,
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
        self._links: dict[str, list[_MockLink]] = {}

    async def open(self, host: str, port: int, options: LinkOptions,
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

    def open_blocking(self, host: str, port: int, options: LinkOptions) -> BlockingLink:
        address = f"{host}:{port}"
        if address in self.down:
            raise KvpoolConnectionError(
                f"cannot connect to kvpool node {address}: connection refused (mock)")
        link = _MockLink(self, address, options)
        self._links.setdefault(address, []).append(link)
        return link

    def drop(self, address: str) -> None:
        """End every open connection to ``address`` (as a node that exits does)."""
        for sock in self._open.pop(address, []):
            sock.lose(None)
        for link in self._links.pop(address, []):
            link.close()


class _MockLink:
    """A sync client's blocking connection on a :class:`MockTransport`: each request
    frame, parsed as a node parses it, goes to the handler in the calling thread, and
    its reply is parsed as one received from a socket (into the caller's buffers)."""

    def __init__(self, owner: MockTransport, address: str, options: LinkOptions) -> None:
        self._owner = owner
        self.peer = address
        self._options = options
        self._requests = RequestParser()
        self._sinks: Sequence[Sink | None] | None = None
        self._replies = ReplyParser(self._sink_for)
        self._count = 0
        self._open = True
        self._next_id = 0
        #: the frame :meth:`begin` holds for :meth:`finish`
        self._begun: tuple[int, int, Sequence[Buffer], Sequence[Sink | None] | None, int] = \
            (0, 0, (), None, 0)

    def begin(self, op: int, count: int, body: Sequence[Buffer],
              sinks: Sequence[Sink | None] | None = None, *, epoch: int = 0) -> None:
        """Holds the frame: :meth:`finish` hands it to the handler (the mock's node answers
        at once, so sending and answering need not be apart)."""
        if not self._open:
            raise KvpoolConnectionError(f"connection to {self.peer} is closed")
        self._begun = (op, count, body, sinks, epoch)

    def finish(self) -> Reply:
        op, count, body, sinks, epoch = self._begun
        return self.call(op, count, body, sinks, epoch=epoch)

    def call(self, op: int, count: int, body: Sequence[Buffer],
             sinks: Sequence[Sink | None] | None = None, *, epoch: int = 0) -> Reply:
        if not self._open:
            raise KvpoolConnectionError(f"connection to {self.peer} is closed")
        self._next_id += 1
        body_len = sum(memoryview(part).nbytes for part in body)
        head = request_head(op, self._next_id, count, body_len, epoch=epoch,
                            scope_flags=self._options.scope_flags)
        reply = None  # a frame the node's parser refused gets none, as on the loop
        for request in self._requests.feed(b"".join([*head, *body])):
            try:
                reply = self._owner.handler(self.peer, request)
            except OSError as exc:
                self.close()
                raise KvpoolConnectionError(f"connection to {self.peer} lost: {exc}") from exc
            finally:
                request.release()
        if reply is None:  # no reply ever: the deadline runs out (at once, here)
            self.close()
            raise KvpoolTimeoutError(f"{Op(op).name} to {self.peer} got no reply within "
                                     f"{self._options.timeout}s")
        self._sinks, self._count = sinks, count
        try:
            replies = self._replies.feed(b"".join(reply))
        except KvpoolError as exc:  # as the socket's link: the stream is not reusable
            self.close()
            raise KvpoolConnectionError(f"bad reply stream from {self.peer}: {exc}") from exc
        finally:
            self._sinks = None
        if len(replies) != 1:
            self.close()
            raise KvpoolConnectionError(f"{self.peer} did not answer request {self._next_id}")
        answer = replies[0]
        if answer.header.request_id != self._next_id:
            return stray_reply(answer, self._next_id, self.peer, self.close)
        problem = reply_mismatch(answer, op, count)
        if problem is not None:
            self.close()
            raise BadReplyError(self.peer, problem)
        return answer

    def _sink_for(self, _request_id: int, index: int, _nbytes: int) -> Sink | None:
        if index >= self._count:
            raise BadFrameError(f"item {index + 1} in the reply to a request of {self._count}")
        return self._sinks[index] if self._sinks is not None else None

    def limit_values(self, max_value_bytes: int) -> None:
        self._replies.max_value_bytes = max_value_bytes

    def stale(self, idle_s: float) -> bool:
        return not self._open

    def fileno(self) -> int:
        return -1

    def close(self) -> None:
        self._open = False


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
