"""One client connection on a node: an ``asyncio.BufferedProtocol``.

Bytes are received by the request parser straight into DRAM arena slots;
replies go out with ``writelines`` as memoryviews of the arena. The write
buffer's high-water mark is 0, so ``pause_writing``/``resume_writing`` tell
exactly when every queued reply has left the process: until then the
entries it references stay acquired (never evicted or reused), and no more
requests are read from this client (backpressure).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import cast

from opentelemetry import trace
from opentelemetry.trace import Span, StatusCode

from kvpool.protocol.errors import BadFrameError, KvpoolError, status_for_error
from kvpool.protocol.frames import Op, encode_error
from kvpool.protocol.parsers import Request, RequestParser
from kvpool.server.handlers import Handlers, Pending, Reply
from kvpool.server.shm import Session
from kvpool.tiers.dram import Entry

__all__ = ["NodeConnection"]

log = logging.getLogger("kvpool.server")


class NodeConnection(asyncio.BufferedProtocol):
    def __init__(self, handlers: Handlers, registry: set[NodeConnection]) -> None:
        self._handlers = handlers
        self._registry = registry
        self._parser = RequestParser(handlers.limits, reserve=handlers.dram.reserve)
        self._transport: asyncio.Transport | None = None
        self._held: list[Entry] = []
        self._write_paused = False
        self._hello_done = False
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._session = Session()
        self.peer = "?"

    # -- asyncio callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._transport.set_write_buffer_limits(high=0, low=0)
        self.peer = str(transport.get_extra_info("peername"))
        self._registry.add(self)
        stats = self._handlers.stats
        stats.connections_open += 1
        stats.connections_total += 1

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._parser.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self._closing:
            return
        for request in self._parser.buffer_updated(nbytes):
            if not self._serve(request):
                return
        if self._parser.error is not None:
            self._fail(0, 0, self._parser.error)

    def eof_received(self) -> bool | None:
        if self._parser.mid_frame:
            log.info("%s: disconnected mid-frame; dropped the partial frame", self.peer)
        return None

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._transport is not None and not self._closing:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._release_held()
        if self._transport is not None and not self._closing:
            self._transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._parser.abort()
        self._release_held()
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
            self._transport.close()

    def _serve(self, request: Request) -> bool:
        header = request.header
        request.session = self._session
        transport = self._transport
        if transport is None:
            return False
        if not self._hello_done:
            if header.op != Op.HELLO:
                self._fail(header.op, header.request_id,
                           BadFrameError("the first frame on a connection must be HELLO"))
                return False
            self._hello_done = True
        tracing = self._handlers.tracing
        if request.trace is not None and tracing is not None:
            span = tracing.request_span(header.op, request.trace, self.peer, header.count)
            with trace.use_span(span, end_on_exit=False):
                return self._dispatch(request, span)
        return self._dispatch(request, None)

    def _dispatch(self, request: Request, span: Span | None) -> bool:
        header = request.header
        started = time.perf_counter()
        try:
            reply = self._handlers.handle(request)
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
            self._send(reply)
            _end_span(span, reply)
            stats = self._handlers.stats
            if stats.timed:
                stats.observe(header.op, time.perf_counter() - started)
        else:  # waits on the SSD tier; its reply goes out when ready, under its request id
            task = asyncio.get_running_loop().create_task(
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
        self._send(reply)
        _end_span(span, reply)
        stats = self._handlers.stats
        if stats.timed:
            stats.observe(op, time.perf_counter() - started)

    def _send(self, reply: Reply) -> None:
        if self._transport is None or self._closing:
            for entry in reply.held:  # the client is gone: nothing will read these views
                self._handlers.dram.release(entry)
            return
        self._transport.writelines(reply.buffers)
        if reply.held:
            if self._write_paused:
                self._held.extend(reply.held)
            else:
                for entry in reply.held:
                    self._handlers.dram.release(entry)

    def _fail(self, op: int, request_id: int, exc: BaseException) -> None:
        """Reply with the error, then close this connection (and only this one)."""
        status = status_for_error(exc)
        self._handlers.stats.error(status, op)
        if isinstance(exc, KvpoolError):
            self._handlers.stats.protocol_errors += 1
        log.info("%s: closing connection: %s: %s", self.peer, type(exc).__name__, exc)
        if self._transport is not None and not self._closing:
            self._transport.writelines(encode_error(op, request_id, status, str(exc),
                                                    epoch=self._handlers.epoch))
        self.close()
        self._parser.abort()

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for entry in held:
            self._handlers.dram.release(entry)


def _end_span(span: Span | None, reply: Reply | None, exc: BaseException | None = None) -> None:
    if span is None:
        return
    if exc is not None:
        span.record_exception(exc)
        span.set_status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
    elif reply is not None and reply.num_bytes:
        span.set_attribute("kvpool.bytes", reply.num_bytes)
    span.end()
