"""One client connection on a node: an ``asyncio.BufferedProtocol``.

Bytes are received by the request parser straight into DRAM arena slots;
replies go out with ``writelines`` as memoryviews of the arena (``writer.py``:
the entries a reply references stay acquired until it has left the process), and
while replies wait no more requests are read from this client (backpressure).

A TLS client that does not read costs the node a bounded amount, however many
values its GETs name (1.1 MiB measured with the TLS layer's own buffers,
``bench/conn_memory.py``), and its reads are paused as on plain TCP.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import cast

from opentelemetry import trace
from opentelemetry.trace import Span, StatusCode

from kvpool.protocol.errors import (
    BadFrameError,
    KvpoolError,
    PermissionDeniedError,
    WrongPortError,
    status_for_error,
)
from kvpool.protocol.frames import Op, encode_error
from kvpool.protocol.parsers import Request, RequestParser, Reservation, Scoper
from kvpool.protocol.wake import WakeMark
from kvpool.server.data.handlers import Handlers
from kvpool.server.data.reply import Pending, Reply
from kvpool.server.data.session import Session
from kvpool.server.data.writer import ReplyWriter
from kvpool.server.security.auth import ANONYMOUS, TokenTable, check, scoper_for
from kvpool.tiers.dram import Slot

__all__ = ["NodeConnection"]

log = logging.getLogger("kvpool.server")


def scope_request(request: Request, scoper: Scoper, quota_tenant: str | None) -> None:
    """Map a frame's keys to the keys they are stored under (the tenant's scope); its PUT
    slots count against ``quota_tenant``'s DRAM quota."""
    scope = request.scope
    if request.items:
        for item in request.items:
            slot = item.reservation
            if isinstance(slot, Slot):
                slot.assign(scoper(slot.key, scope), quota_tenant)
            if item.parent is not None:
                item.parent = scoper(item.parent, scope)
        if request.header.op in (Op.PUT_SHM, Op.COMMIT_AS):  # slots are keyed by these
            request.keys = [scoper(item.header.key, scope) for item in request.items]
    elif request.keys:
        request.client_keys = request.keys
        request.keys = [scoper(k, scope) for k in request.keys]


def http_wrong_port(message: str, admin: tuple[str, int]) -> bytes:
    """An HTTP 400 in the admin API's error shape, for an HTTP request on the data port."""
    body = json.dumps({"error": {"type": "wrong_port", "message": (
        f"{message}; this node's admin API: http://{admin[0]}:{admin[1]}")}}).encode()
    return (b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)) + body


class Timeouts:
    """When a connection last did each thing (loop time), against its timeouts: what
    :meth:`NodeConnection._check_timeouts` judges every ``period`` seconds."""

    __slots__ = ("frame_since", "hello", "idle", "last_rx", "made_at", "paused_since")

    def __init__(self, hello_timeout_s: float, idle_timeout_s: float) -> None:
        self.hello = hello_timeout_s
        self.idle = idle_timeout_s  #: 0: none
        self.made_at = self.last_rx = 0.0
        #: since when a frame has been arriving (None: between frames)
        self.frame_since: float | None = None
        #: since when replies have waited for the peer to read them (None: none wait)
        self.paused_since: float | None = None

    @property
    def period(self) -> float:
        return max(0.05, min([self.hello] + ([self.idle] if self.idle else [])) / 4)

    def received(self, now: float, mid_frame: bool) -> None:
        """Bytes came in at ``now``; ``mid_frame``: a frame is still arriving."""
        self.last_rx = now
        if not mid_frame:
            self.frame_since = None
        elif self.frame_since is None:
            self.frame_since = now

    def overdue(self, now: float, *, hello_done: bool, busy: bool) -> str:
        """Why the connection must close at ``now`` ("": it need not); ``busy``: requests
        of it are still being served."""
        idle = self.idle
        if not hello_done and now - self.made_at > self.hello:
            return f"no HELLO within {self.hello}s"
        if not idle:
            return ""
        if self.frame_since is not None and now - self.frame_since > idle:
            return f"one frame took longer than {idle}s to arrive"
        if self.paused_since is not None and now - self.paused_since > idle:
            return f"replies left unread for {idle}s"
        if self.frame_since is None and self.paused_since is None and not busy \
                and now - self.last_rx > idle:
            return f"idle for {idle}s"
        return ""


class NodeConnection(asyncio.BufferedProtocol):
    """One data connection: parse, authorise, dispatch, reply; timeouts and limits.

    Keys are mapped to the authenticated tenant's scope here, when a frame is
    served (not when it is parsed: frames pipelined behind HELLO are parsed
    before HELLO is served), PUT slots included.

    Hostile peers: at most ``max_connections`` are served (more are closed at
    accept); a connection that has not said HELLO within ``hello_timeout_s``,
    sent nothing for ``idle_timeout_s``, spent longer than that on one frame
    (slow-loris), or left replies unread that long, is closed. What a
    connection buffers is bounded by the frame limits: a frame's header is
    checked before its body is read, and no more is read while replies wait.
    """

    def __init__(self, handlers: Handlers, registry: set[NodeConnection], *,
                 max_connections: int = 1 << 30, idle_timeout_s: float = 0.0,
                 hello_timeout_s: float = 10.0) -> None:
        self._handlers = handlers
        self._registry = registry
        self._max_connections = max_connections
        self._timeouts = Timeouts(hello_timeout_s, idle_timeout_s)
        self._timer: asyncio.TimerHandle | None = None
        #: the loop it runs on (the server makes its protocols there), kept:
        #: ``asyncio.get_running_loop()`` makes a getpid system call each time on CPython
        #: 3.11, and a request asked it up to twice
        self._loop = asyncio.get_running_loop()
        self._rejected = False
        self._parser = RequestParser(handlers.limits, reserve=self._reserve,
                                     hold_after_hello=True)
        self._scoper: Scoper | None = None
        #: whose DRAM quota this connection's PUTs count against (None: no one's)
        self._quota_tenant: str | None = None
        self._transport: asyncio.Transport | None = None
        self._replies = ReplyWriter(handlers.dram.release)
        self._hello_done = False
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._session = Session()
        self.peer = "?"
        #: when the kernel wakes the node for this connection (set once connected)
        self._wake = WakeMark(None)

    # -- asyncio callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self.peer = str(transport.get_extra_info("peername"))
        stats = self._handlers.stats
        if len(self._registry) >= self._max_connections:
            self._rejected = self._closing = True
            stats.connections_rejected += 1
            log.warning("%s: refused: %d connections open (--max-connections)", self.peer,
                        len(self._registry))
            self._transport.abort()
            return
        self._replies.attach(self._transport)
        if transport.get_extra_info("sslcontext") is None:
            self._wake = WakeMark(transport.get_extra_info("socket"))
        self._registry.add(self)
        stats.connections_open += 1
        stats.connections_total += 1
        loop = self._loop
        self._timeouts.made_at = self._timeouts.last_rx = loop.time()
        self._timer = loop.call_later(self._timeouts.period, self._check_timeouts)

    def _check_timeouts(self) -> None:
        self._timer = None
        if self._transport is None or self._closing:
            return
        loop = self._loop
        why = self._timeouts.overdue(loop.time(), hello_done=self._hello_done,
                                     busy=bool(self._tasks))
        if why:
            self._handlers.stats.connections_timed_out += 1
            log.info("%s: closing: %s", self.peer, why)
            self._closing = True
            self._transport.abort()  # the peer is not reading: a graceful close could hang
            return
        self._timer = loop.call_later(self._timeouts.period, self._check_timeouts)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._parser.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self._closing:
            return
        parser = self._parser
        if parser.more_of_value(nbytes):  # mid-value: nothing completes
            if self._wake.mark > 1:  # woken early (a full receive buffer): wait for the rest
                self._wake.expect(parser.value_left)
            if self._timeouts.idle:
                self._timeouts.received(self._loop.time(), True)
            return
        requests = parser.buffer_updated(nbytes)
        while True:
            for i, request in enumerate(requests):
                if not self._serve(request):
                    # this frame failed and the connection is closing: what this frame and
                    # the ones parsed behind it received into DRAM slots goes back (a
                    # committed slot's release is a no-op)
                    for dropped in requests[i:]:
                        dropped.release()
                    return
            if not parser.holding:
                break
            requests = parser.resume()  # HELLO served: who the peer is decides what follows
        if parser.error is not None:
            self._fail(0, 0, parser.error)
            return
        self._wake.expect(parser.value_left)
        if self._timeouts.idle:
            self._timeouts.received(self._loop.time(), self._parser.mid_frame)

    def eof_received(self) -> bool | None:
        if self._parser.mid_frame:
            log.info("%s: disconnected mid-frame; dropped the partial frame", self.peer)
        return None

    def pause_writing(self) -> None:
        self._replies.paused = True
        self._timeouts.paused_since = self._loop.time()
        if self._transport is not None and not self._closing:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._timeouts.paused_since = None
        if not self._replies.resumed():  # TLS replies copied in filled the transport again
            return
        if self._transport is not None and not self._closing:
            self._transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._rejected:
            self._transport = None
            return
        self._wake.close()
        self._parser.abort()
        self._replies.drop()
        if self._handlers.shm is not None:
            self._handlers.shm.close_session(self._session)
        self._registry.discard(self)
        self._handlers.stats.connections_open -= 1
        self._transport = None

    # -- serving --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop reading; close once queued replies are written (graceful shutdown)."""
        if self._transport is not None and not self._closing:
            self._closing = True
            if self._replies.copying:  # TLS replies still to copy: closed once they are
                self._replies.close_when_sent()
                self._transport.pause_reading()
            else:
                self._transport.close()

    def _serve(self, request: Request) -> bool:
        header = request.header
        transport = self._transport
        if transport is None:
            return False
        if not self._hello_done:
            if header.op != Op.HELLO:
                self._fail(header.op, header.request_id,
                           BadFrameError("the first frame on a connection must be HELLO"))
                return False
            self._hello_done = True
            if not self._dispatch(request, None):
                return False
            principal = self._session.principal
            self._scoper = scoper_for(principal)
            self._quota_tenant = principal.quota_tenant
            return True
        why = check(self._session.principal, header.op, request.scope)
        if why is not None:
            self._refuse(request, PermissionDeniedError(why))
            return True
        if self._scoper is not None:
            scope_request(request, self._scoper, self._quota_tenant)
        tracing = self._handlers.tracing
        if request.trace is not None and tracing is not None:
            span = tracing.request_span(header.op, request.trace, self.peer, header.count)
            with trace.use_span(span, end_on_exit=False):
                return self._dispatch(request, span)
        return self._dispatch(request, None)

    def _reserve(self, key: bytes, nbytes: int, scope: int) -> Reservation | None:
        # Authenticate before you allocate: the parser holds after HELLO until it is served,
        # so a PUT parsed here with no HELLO served came first on the connection, and is
        # refused before a byte is reserved (or anything evicted) for it. A PUT the caller
        # may not send is skipped, not received (it is refused when served).
        if not self._hello_done:
            raise BadFrameError("the first frame on a connection must be HELLO")
        if check(self._session.principal, Op.PUT, scope) is not None:
            return None
        return self._handlers.dram.reserve(key, nbytes, self._quota_tenant)

    def _refuse(self, request: Request, exc: KvpoolError) -> None:
        """Answer one frame with an error and keep the connection (nothing was done)."""
        request.release()
        header = request.header
        self._handlers.stats.error(status_for_error(exc), header.op)
        if self._transport is not None and not self._closing:
            self._replies.write(encode_error(header.op, header.request_id,
                                             status_for_error(exc), str(exc),
                                             epoch=self._handlers.epoch))

    def recheck(self, table: TokenTable) -> bool:
        """After a tokens reload: close (True) unless the token still means the same."""
        if not self._hello_done:
            return False
        session = self._session
        now = ANONYMOUS if table.open else \
            table.principal_of(session.token_digest) if session.token_digest else None
        if now == session.principal:
            return False
        log.info("%s: the token of %s was revoked or changed: closing", self.peer,
                 session.principal)
        self.close()
        return True

    def _dispatch(self, request: Request, span: Span | None) -> bool:
        header = request.header
        started = time.perf_counter()
        try:
            reply = self._handlers.handle(request, self._session)
        except KvpoolError as exc:
            _end_span(span, None, exc)
            self._fail(header.op, header.request_id, exc)
            return False
        except Exception as exc:
            log.exception("%s: internal error on %s", self.peer, Op(header.op).name)
            _end_span(span, None, exc)
            self._fail(header.op, header.request_id, exc)
            return False
        if isinstance(reply, Reply):
            self._send(header.op, reply, started, span)
        else:  # waits on the SSD tier; its reply goes out when ready, under its request id
            task = self._loop.create_task(
                self._finish(header.op, header.request_id, reply, started, span))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return True

    async def _finish(self, op: int, request_id: int, pending: Pending, started: float,
                      span: Span | None) -> None:
        try:
            reply = await pending
        except KvpoolError as exc:
            _end_span(span, None, exc)
            self._fail(op, request_id, exc)
            return
        except Exception as exc:
            log.exception("%s: internal error on %s", self.peer, Op(op).name)
            _end_span(span, None, exc)
            self._fail(op, request_id, exc)
            return
        self._send(op, reply, started, span)

    def _send(self, op: int, reply: Reply, started: float, span: Span | None) -> None:
        if self._transport is None or self._closing:
            for entry in reply.held:  # the client is gone: nothing will read these views
                self._handlers.dram.release(entry)
        else:
            self._replies.write(reply.buffers, reply.held)
        _end_span(span, reply)
        stats = self._handlers.stats
        if stats.timed:
            stats.observe(op, time.perf_counter() - started)

    def _fail(self, op: int, request_id: int, exc: BaseException) -> None:
        """Reply with the error, then close this connection (and only this one)."""
        status = status_for_error(exc)
        self._handlers.stats.error(status, op)
        if isinstance(exc, KvpoolError):
            self._handlers.stats.protocol_errors += 1
        log.info("%s: closing connection: %s: %s", self.peer, type(exc).__name__, exc)
        if self._transport is not None and not self._closing:
            if isinstance(exc, WrongPortError):  # an HTTP client: an answer it can read
                self._replies.write([http_wrong_port(str(exc), self._handlers.addresses[1])])
            else:
                self._replies.write(encode_error(op, request_id, status, str(exc),
                                                 epoch=self._handlers.epoch))
        self.close()
        self._parser.abort()


def _end_span(span: Span | None, reply: Reply | None, exc: BaseException | None = None) -> None:
    if span is None:
        return
    if exc is not None:
        span.record_exception(exc)
        span.set_status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
    elif reply is not None and reply.num_bytes:
        span.set_attribute("kvpool.bytes", reply.num_bytes)
    span.end()


async def close_all(connections: set[NodeConnection], grace_s: float) -> None:
    """Close ``connections``, letting each flush the replies it owes, for at most
    ``grace_s``."""
    for conn in list(connections):
        conn.close()
    # connections leave the registry in connection_lost; poll rather than wire an event
    # through every connection, for a path that runs once per process
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while connections and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
