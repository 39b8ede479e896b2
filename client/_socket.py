"""One blocking socket to a node, for the sync client: a request, then its reply.

:class:`BlockingConnection` is what :meth:`TcpTransport.open_blocking
<kvpool.client.transport.TcpTransport.open_blocking>` opens for the sync client's
loop-free calls (:mod:`kvpool.client._blocking` drives the op plans over it). The
request goes out in one ``send``; a small reply is received whole in one
``recv_into`` and parsed in one pass; a larger one goes on through the streamed
reply parser, a GET payload straight into the caller's buffer, checksummed as it
arrives, as the async path does.
"""

from __future__ import annotations

import select
import socket
import ssl as ssl_module
import struct
import sys
import time
from collections.abc import Callable, Sequence

from kvpool.client._connection import Buffer, request_head, trailer_runs
from kvpool.client._plans import Sink
from kvpool.protocol.errors import (
    BadFrameError,
    BadReplyError,
    KvpoolConnectionError,
    KvpoolError,
    KvpoolTimeoutError,
    Status,
)
from kvpool.protocol.frames import Op
from kvpool.protocol.parsers import Reply, ReplyParser, reply_mismatch

__all__ = ["BlockingConnection", "busy_poll", "sendmsg_all", "stray_reply"]

#: bodies up to this size are joined and sent with one ``send``; larger ones go as a
#: ``sendmsg`` of their parts (no copy of the values)
_JOIN_BELOW = 64 << 10
#: parts per ``sendmsg`` (Linux's IOV_MAX is 1024)
_IOV_MAX = 1024
#: bytes a reply's first receive takes at most (a GET of a value up to about this size
#: then arrives in one receive: a few KiB of a cache's small values, hashes, codes)
_FIRST_RECEIVE = 64 << 10

#: a GET payload with at least this much still to come is received with MSG_WAITALL,
#: up to _WAIT_MAX bytes a receive: the thread is woken once per _WAIT_MAX, not at every
#: segment the node's kernel hands over (each such wake-up is paid in the node's send;
#: the loop's connections do the same with SO_RCVLOWAT, protocol/wake.py). 256 KiB:
#: 1.07-1.23x (1 MiB) and 1.36-1.37x (4 MiB) one a call in paired runs; 128 KiB and
#: 512 KiB no better, a whole value 0.94-1.00x
_WAIT_MIN = 64 << 10
_WAIT_MAX = 256 << 10

#: a call polls for its reply only where its request body and the buffers its reply may
#: fill are this small: the node answers it within microseconds. A reply that takes time
#: to make (a put's megabyte received and stored) outlasts the poll, which only burns CPU
#: (1 MiB puts: +0.07 ms CPU a call, no faster), and one of many megabytes came no sooner
#: polled (a 4 MiB get_into measured 1.17 against 1.33 ms p50, in noise)
_POLL_MAX_BYTES = 64 << 10


def _small_call(body_len: int, sinks: Sequence[Sink | None] | None) -> bool:
    """Whether a call with this request body and reply buffers gets its reply polled for
    (``sinks`` None: a GET into new buffers, or a key op; their replies are small)."""
    if body_len > _POLL_MAX_BYTES:
        return False
    if sinks is None:
        return True
    room = 0
    for sink in sinks:
        if sink is not None:
            room += sink.nbytes
    return room <= _POLL_MAX_BYTES


def busy_poll(poll: select.poll, ns: int) -> list[tuple[int, int]]:
    """``poll``'s ready descriptors, polled without sleeping for up to ``ns`` nanoseconds
    (``ClientOptions.busy_poll_us``); empty if none was ready by then (the caller then
    sleeps on them). A reply that comes while the thread polls needs no wake-up."""
    if ns <= 0:
        return []
    end = time.perf_counter_ns() + ns
    while True:
        ready = poll.poll(0)
        if ready or time.perf_counter_ns() >= end:
            return ready


def sendmsg_all(sock: socket.socket, parts: Sequence[Buffer],
                after_each: Callable[[], None] | None = None) -> None:
    """Send ``parts`` whole with as few ``sendmsg`` calls as the kernel takes (up to
    ``_IOV_MAX`` parts each), ``after_each`` one (a deadline check) between them."""
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    first = 0
    while first < len(views):
        sent = sock.sendmsg(views[first : first + _IOV_MAX])
        while sent:
            n = views[first].nbytes
            if sent < n:
                views[first] = views[first][sent:]
                break
            sent -= n
            first += 1
        if after_each is not None:
            after_each()


#: a ``struct timeval`` (Linux: two longs), for SO_RCVTIMEO and SO_SNDTIMEO
_TIMEVAL = struct.Struct("@ll")


def _timeval(seconds: float) -> bytes:
    """``seconds`` (at least 1 ms) as a socket timeout; a year or more: none (0)."""
    if not seconds < 365 * 86400:
        return _TIMEVAL.pack(0, 0)
    seconds = max(seconds, 1e-3)
    whole = int(seconds)
    return _TIMEVAL.pack(whole, int((seconds - whole) * 1e6))


def stray_reply(reply: Reply, request_id: int, peer: str, close: Callable[[], None]) -> Reply:
    """A ``reply`` under another id than ``request_id``, the one request in flight: it ends
    a blocking link (``close``). An error frame (the node refused the frame itself) is
    still handed back; anything else is KvpoolConnectionError. (Called only on a mismatch:
    the caller compares the ids.)"""
    close()
    if reply.header.status == Status.OK:
        raise KvpoolConnectionError(
            f"{peer} answered request {reply.header.request_id}, not {request_id}")
    return reply


class BlockingConnection:
    """One blocking socket to a node: a request, then its reply, within ``timeout``."""

    def __init__(self, host: str, port: int, *, timeout: float, connect_timeout: float,
                 ssl: ssl_module.SSLContext | None = None, scope_flags: int = 0,
                 max_reply_body: int = 64 << 20, busy_poll_us: float = 0.0) -> None:
        self.peer = f"{host}:{port}"
        self._timeout = timeout
        #: how long a small call's reply is polled for before the thread sleeps
        #: (:func:`busy_poll`), and for the call in flight (:func:`_small_call`)
        self._busy_poll_ns = int(busy_poll_us * 1000)
        self._spin_ns = 0
        self._scope_flags = scope_flags
        self._sinks: Sequence[Sink | None] | None = None
        self._parser = ReplyParser(self._sink_for, max_reply_body)
        #: a reply's first receive (a small reply's all)
        self._scratch = bytearray(_FIRST_RECEIVE)
        self._scratch_view = memoryview(self._scratch)
        self._next_id = 0
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
        except TimeoutError:
            raise KvpoolTimeoutError(
                f"connecting to {self.peer} took longer than {connect_timeout}s") from None
        except OSError as exc:
            raise KvpoolConnectionError(f"cannot connect to kvpool node {self.peer}: {exc}"
                                        ) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ssl is not None:
            try:
                sock = ssl.wrap_socket(sock, server_hostname=host)
            except OSError as exc:  # ssl.SSLError included
                sock.close()
                raise KvpoolConnectionError(f"TLS to kvpool node {self.peer} failed: {exc}"
                                            ) from exc
        self._sock: socket.socket | None = sock
        self._tls = ssl is not None
        #: Linux, plain TCP: the socket stays in blocking mode and the kernel keeps the
        #: timeout (SO_RCVTIMEO, SO_SNDTIMEO). A Python timeout would make every call
        #: two ioctl(FIONBIO) and a poll() before each send and receive: 4 more system
        #: calls on a small request than its send and its receive.
        self._kernel_timeouts = not self._tls and sys.platform == "linux"
        if self._kernel_timeouts:
            sock.settimeout(None)
            self._set_kernel_timeouts(sock, timeout)
        #: per kernel timeout (SO_RCVTIMEO, SO_SNDTIMEO): when the call in flight began,
        #: or when that timeout was last cut to what was left of the call
        self._limited_at: dict[int, float] = {}
        #: the socket's kernel timeouts are shorter than a whole call's
        self._cut = False
        #: the request :meth:`begin` sent: op, request id, deadline, item count
        self._flight = (0, 0, 0.0, 0)
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)
        #: monotonic time of the last reply (the node closes connections idle for long)
        self.last_used = time.monotonic()

    @property
    def is_open(self) -> bool:
        return self._sock is not None

    def stale(self, idle_s: float) -> bool:
        """Whether this connection should not carry another request: closed here; the node
        ended it (anything readable between requests is its EOF or an error frame);
        or idle for most of the node's idle timeout (``idle_s``; 0: none)."""
        if self._sock is None:
            return True
        if self._poll.poll(0):
            return True
        return bool(idle_s) and time.monotonic() - self.last_used >= idle_s * 0.75

    def fileno(self) -> int:
        return self._sock.fileno() if self._sock is not None else -1

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def call(self, op: int, count: int, body: Sequence[Buffer],
             sinks: Sequence[Sink | None] | None = None, *, epoch: int = 0) -> Reply:
        """Send one request frame and wait for its reply (any status: the caller checks).

        Any failure closes the connection: a reply may be half read.
        """
        self.begin(op, count, body, sinks, epoch=epoch)
        return self.finish()

    def begin(self, op: int, count: int, body: Sequence[Buffer],
              sinks: Sequence[Sink | None] | None = None, *, epoch: int = 0) -> None:
        """Send one request frame; :meth:`finish` waits for its reply. Its deadline runs
        from now. (:meth:`call` in two halves: a caller sends a frame to each of several
        nodes, then reads each reply.)"""
        sock = self._sock
        if sock is None:
            raise KvpoolConnectionError(f"connection to {self.peer} is closed")
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        start = time.monotonic()
        self._flight = (op, self._next_id, start + self._timeout, count)
        self._limited_at = {socket.SO_RCVTIMEO: start, socket.SO_SNDTIMEO: start}
        if self._cut:
            self._set_kernel_timeouts(sock, self._timeout)
        self._sinks = sinks
        body_len = 0
        for part in body:
            body_len += len(part) if type(part) is bytes else memoryview(part).nbytes
        self._spin_ns = self._busy_poll_ns if _small_call(body_len, sinks) else 0
        try:
            head = request_head(op, self._next_id, count, body_len, epoch=epoch,
                                scope_flags=self._scope_flags)
            self._send(sock, [*head, *body], len(head[0]) + body_len, start + self._timeout)
        except BaseException as exc:
            raise self._failure(op, exc)  # noqa: B904 (_failure sets its cause)

    def finish(self) -> Reply:
        """The reply to the frame :meth:`begin` sent (any status: the caller checks)."""
        op, request_id, deadline, count = self._flight
        sock = self._sock
        if sock is None:
            raise KvpoolConnectionError(f"connection to {self.peer} is closed")
        try:
            reply = self._receive(sock, deadline)
        except BaseException as exc:
            raise self._failure(op, exc)  # noqa: B904 (_failure sets its cause)
        finally:
            self._sinks = None
        if reply.header.request_id != request_id:
            return stray_reply(reply, request_id, self.peer, self.close)
        problem = reply_mismatch(reply, op, count)
        if problem is not None:  # a node that answers another question is not trusted
            self.close()
            raise BadReplyError(self.peer, problem)
        self.last_used = time.monotonic()
        return reply

    def limit_values(self, max_value_bytes: int) -> None:
        """GET values received into buffers of the connection's own are at most this
        large (the node's ``max_value_bytes``, from its checked HELLO)."""
        self._parser.max_value_bytes = max_value_bytes

    def _failure(self, op: int, exc: BaseException) -> BaseException:
        """What ends a call that ``exc`` interrupted: the connection closes (a reply may be
        half read) and the caller gets a KvpoolConnectionError, or its timeout subclass;
        anything not an I/O or stream error (KeyboardInterrupt mid-reply) as it is."""
        self.close()
        self._sinks = None
        error: BaseException
        if isinstance(exc, TimeoutError | BlockingIOError):  # the latter: a kernel timeout
            error = KvpoolTimeoutError(
                f"{Op(op).name} to {self.peer} got no reply within {self._timeout}s")
            error.__suppress_context__ = True
            return error
        if isinstance(exc, KvpoolError):
            error = KvpoolConnectionError(f"bad reply stream from {self.peer}: {exc}")
        elif isinstance(exc, OSError):
            error = KvpoolConnectionError(f"connection to {self.peer} lost: {exc}")
        else:
            return exc
        error.__cause__ = exc
        return error

    def _send(self, sock: socket.socket, parts: list[Buffer], total: int,
              deadline: float) -> None:
        self._limit(sock, deadline, socket.SO_SNDTIMEO)
        if total < _JOIN_BELOW:
            sock.sendall(b"".join(part for run in trailer_runs(parts) for part in run))
            return
        for run in trailer_runs(parts):
            if self._tls:  # an SSL socket has no sendmsg
                for part in run:
                    sock.sendall(part)
                continue
            sendmsg_all(sock, run, lambda: self._limit(sock, deadline, socket.SO_SNDTIMEO))

    def _receive(self, sock: socket.socket, deadline: float) -> Reply:
        """The reply to the one request in flight. Every reply starts on an empty parser:
        one request at a time, a stream that ends past its reply is refused below, and any
        failure closes the connection."""
        # a small reply comes whole in the first receive: parsed in one pass, without the
        # streamed parser's steps (a GET payload's bytes are copied and checksummed as
        # that parser would); anything longer goes on through that parser
        self._limit(sock, deadline, socket.SO_RCVTIMEO, first=True)
        busy_poll(self._poll, self._spin_ns)
        n = sock.recv_into(self._scratch)
        if not n:
            raise OSError("the node closed the connection")
        first = self._scratch_view[:n]
        parser = self._parser
        parsed = parser.whole_reply(first)
        if parsed is not None:
            if parsed[1] != n:
                raise OSError("the node sent replies to requests not made")
            return parsed[0]
        replies = parser.feed(first)
        whole = self._kernel_timeouts  # (a socket timeout of Python's own polls: no waiting)
        while not replies:
            self._limit(sock, deadline, socket.SO_RCVTIMEO)
            left = parser.value_left if whole else 0
            if left >= _WAIT_MIN:  # partial only at the kernel's timeout (or a signal)
                n = sock.recv_into(parser.get_buffer(-1), min(left, _WAIT_MAX),
                                   socket.MSG_WAITALL)
            else:
                n = sock.recv_into(parser.get_buffer(-1))
            if not n:
                raise OSError("the node closed the connection")
            replies = parser.buffer_updated(n)
        if len(replies) > 1 or not parser.between_replies:
            raise OSError("the node sent replies to requests not made")
        return replies[0]

    def _limit(self, sock: socket.socket, deadline: float, option: int, *,
               first: bool = False) -> None:
        """Before a send or a receive of the call that ends at ``deadline``: what is left
        of it as the socket's timeout. The kernel's timeout (``option``) is cut only once
        more than a 16th of the call's timeout has passed since the call began or since
        that timeout was last cut, so a long reply is not a system call more per receive;
        a wait then ends at most that 16th past the deadline. Past the deadline, the
        ``first`` receive of a reply still gets 1 ms (a reply that came while the caller
        read another node's is taken); any other I/O is a timeout."""
        now = time.monotonic()
        left = deadline - now
        if left <= 0 and not first:
            raise TimeoutError
        if not self._kernel_timeouts:
            sock.settimeout(max(left, 1e-3))
        elif left < 1e-3 or now - self._limited_at[option] > self._timeout / 16:
            sock.setsockopt(socket.SOL_SOCKET, option, _timeval(deadline - now))
            self._limited_at[option] = now
            self._cut = True

    def _set_kernel_timeouts(self, sock: socket.socket, seconds: float) -> None:
        full = _timeval(seconds)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, full)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, full)
        self._cut = False

    def _sink_for(self, request_id: int, index: int, nbytes: int) -> Sink | None:
        count = self._flight[3]
        if index >= count:
            raise BadFrameError(f"item {index + 1} in the reply to a request of {count}")
        sinks = self._sinks
        return sinks[index] if sinks is not None else None
