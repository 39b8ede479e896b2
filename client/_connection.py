"""One pipelined connection to a node: an ``asyncio.BufferedProtocol``.

Requests carry ids; replies are matched to them, and GET payloads are
received by the reply parser straight into the caller's buffers (checksummed
as they arrive). A broken connection fails every request still waiting on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import cast

from kvpool.client._shm import Ahead
from kvpool.client._tracing import wire_context
from kvpool.protocol.envelope import ChecksumTrailer
from kvpool.protocol.errors import (
    BadFrameError,
    BadReplyError,
    KvpoolConnectionError,
    KvpoolError,
    KvpoolTimeoutError,
)
from kvpool.protocol.frames import OP_FLAG_TRACE, SCOPED_OPS, Op, pack_frame_header
from kvpool.protocol.parsers import Reply, ReplyParser, Segments, reply_mismatch
from kvpool.protocol.wake import WakeMark

__all__ = ["Connection", "request_head", "trailer_runs"]

Buffer = bytes | bytearray | memoryview
#: a buffer, or a list of buffers used in order as one (like readv/writev)
BufferOrSegments = Buffer | list[Buffer] | tuple[Buffer, ...]

#: a checksum trailer's value goes out in pieces of at most this size, each hashed once it
#: is sent (while the node reads it; 1 MiB did better than 256 KiB, 512 KiB and 2 MiB
#: on the 2-core VM, bench notes in docs/notebook/2026-12-06-peers.md)
_PIECE = 1 << 20
#: a run shorter than this is not sent ahead of its hashing (a write of its own would cost
#: more than the overlap gains)
_RUN_MIN = 64 << 10


def trailer_runs(parts: Sequence[Buffer]) -> Iterator[list[Buffer]]:
    """``parts`` in runs to write in turn, each :class:`ChecksumTrailer` filled in before
    the run that carries it. A trailer's value (the parts just before it) goes out in
    pieces of up to ``_PIECE`` bytes, each hashed after the caller has sent it (once
    ``_RUN_MIN`` bytes are waiting), so the hash runs while the node reads the bytes
    sent. Without trailers: one run, ``parts`` as they are."""
    owners: dict[int, ChecksumTrailer] = {}  # index of a value's first part -> its trailer
    for i, part in enumerate(parts):
        if type(part) is ChecksumTrailer:
            first = i - len(part.segments)
            if first < 0 or any(parts[first + k] is not seg
                                for k, seg in enumerate(part.segments)):
                raise ValueError("a checksum trailer must follow its value's parts")
            owners[first] = part
    if not owners:
        yield list(parts)
        return
    run: list[Buffer] = []
    pending = 0
    owner: ChecksumTrailer | None = None
    for i, part in enumerate(parts):
        if i in owners:
            owner = owners[i]
        if type(part) is ChecksumTrailer:
            part.fill()
            owner = None
        elif owner is not None:  # a part of a trailer's value: in pieces, each hashed once sent
            view = memoryview(part).cast("B")
            for start in range(0, view.nbytes, _PIECE):
                piece = view[start : start + _PIECE]
                run.append(piece)
                pending += piece.nbytes
                if pending >= _RUN_MIN:
                    yield run
                    run, pending = [], 0
                owner.update(piece)
            continue
        run.append(part)
        pending += part.nbytes if type(part) is memoryview else len(part)
    yield run


def request_head(op: int, request_id: int, count: int, body_len: int, *, epoch: int,
                 scope_flags: int) -> list[Buffer]:
    """What goes before a request's body: its frame header (the op with the connection's
    scope bits), then the current span's trace context if a span is sampled."""
    trace = wire_context()
    wire_op = op | scope_flags if op in SCOPED_OPS else op
    if trace is None:
        return [pack_frame_header(wire_op, request_id, count, body_len, epoch=epoch)]
    return [pack_frame_header(wire_op | OP_FLAG_TRACE, request_id, count,
                              body_len + len(trace), epoch=epoch), trace]


class _Pending:
    __slots__ = ("count", "deadline", "future", "op", "sinks")

    def __init__(self, future: asyncio.Future[Reply],
                 sinks: Sequence[memoryview | Segments | None] | None,
                 op: int, count: int, deadline: float) -> None:
        self.future = future
        self.sinks = sinks
        self.op = op
        self.count = count
        self.deadline = deadline


class Connection(asyncio.BufferedProtocol):
    """Pipelined requests with one deadline each.

    Deadlines are checked by one watchdog timer per connection rather than a
    timer per request (``asyncio.timeout`` costs ~20 us a call here). A request
    past its deadline aborts the whole connection: its reply could still
    arrive and write into the caller's buffer, so the stream cannot be reused.
    """

    def __init__(self, timeout: float = 10.0, peer: str = "",
                 max_reply_body: int = 64 << 20) -> None:
        self._parser = ReplyParser(self._sink_for, max_reply_body)
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self._transport: asyncio.Transport | None = None
        self._lost: KvpoolError | None = None
        self._timeout = timeout
        self._peer = peer
        self._watchdog: asyncio.TimerHandle | None = None
        #: the node granted this connection its shared-memory arena (GET_SHM)
        self.shm = False
        #: ... and for writing (PUT_SHM, COMMIT): a client of the node's own user
        self.shm_write = False
        #: arena slots the node reserved for this connection's next puts of the same sizes
        self.put_ahead: list[Ahead] = []
        #: ... and those it gave up, to release
        self.put_unwanted: list[Ahead] = []
        #: OP_FLAG_SHARED or OP_FLAG_RAW on every key op and PUT (0: the tenant's scope)
        self.scope_flags = 0
        #: loop time of the last request sent or reply received (idle connections are
        #: replaced before the node's idle timeout closes them under a request)
        self.last_used = 0.0
        #: when the kernel wakes the loop for this connection (set once connected)
        self._wake = WakeMark(None)

    @property
    def is_open(self) -> bool:
        return self._transport is not None and self._lost is None

    def limit_values(self, max_value_bytes: int) -> None:
        """GET values received into buffers of the connection's own are at most this
        large (the node's ``max_value_bytes``, from its checked HELLO)."""
        self._parser.max_value_bytes = max_value_bytes

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def send(self, op: int, count: int, body: Sequence[Buffer],
             sinks: Sequence[memoryview | Segments | None] | None = None, *,
             epoch: int = 0) -> asyncio.Future[Reply]:
        """Write one request frame; the future resolves with its reply."""
        if self._lost is not None or self._transport is None:
            raise self._lost or KvpoolConnectionError(f"connection to {self._peer} is not open")
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        request_id = self._next_id
        body_len = sum(memoryview(b).nbytes for b in body)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Reply] = loop.create_future()
        self.last_used = loop.time()
        self._pending[request_id] = _Pending(future, sinks, op, count,
                                             loop.time() + self._timeout)
        for run in trailer_runs([*request_head(op, request_id, count, body_len, epoch=epoch,
                                               scope_flags=self.scope_flags), *body]):
            self._transport.writelines(run)
        if self._watchdog is None:
            self._watchdog = loop.call_later(self._check_interval, self._check_deadlines)
        return future

    @property
    def _check_interval(self) -> float:
        return max(0.005, self._timeout / 10)

    def _check_deadlines(self) -> None:
        self._watchdog = None
        if not self._pending:
            return
        oldest = next(iter(self._pending.values()))  # dicts keep insertion order
        loop = asyncio.get_running_loop()
        if oldest.deadline <= loop.time():
            self._fail(KvpoolTimeoutError(
                f"{Op(oldest.op).name} to {self._peer} got no reply within {self._timeout}s"))
            if self._transport is not None:
                self._transport.abort()
            return
        self._watchdog = loop.call_later(self._check_interval, self._check_deadlines)

    def abort(self, reason: str) -> None:
        """Drop the connection now (after a timeout its stream state is unknown)."""
        self._fail(KvpoolConnectionError(reason))
        if self._transport is not None:
            self._transport.abort()

    def close(self) -> None:
        self._fail(KvpoolConnectionError("connection closed by the client"))
        if self._transport is not None:
            self._transport.close()

    # -- asyncio callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        if transport.get_extra_info("sslcontext") is None:
            # (the mark's default most, 512 KiB: 1.07-1.15x on 1 and 4 MiB GETs, one and 16
            # a call, in paired runs; 128 KiB 1.00-1.02x, a whole MiB 0.86-1.16x)
            self._wake = WakeMark(transport.get_extra_info("socket"))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._parser.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        try:
            replies = self._parser.buffer_updated(nbytes)
        except KvpoolError as exc:
            self.abort(f"bad reply stream from {self._peer}: {exc}")
            return
        self._wake.expect(self._parser.value_left)
        for reply in replies:
            pending = self._pending.pop(reply.header.request_id, None)
            if pending is None or pending.future.done():
                continue
            problem = reply_mismatch(reply, pending.op, pending.count)
            if problem is not None:  # a node that answers another question is not trusted
                pending.future.set_exception(BadReplyError(self._peer, problem))
                self.abort(f"{self._peer} sent a bad reply: {problem}")
                return
            pending.future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._wake.close()
        reason = f"connection to {self._peer} lost: {exc}" if exc else \
            f"{self._peer} closed the connection"
        self._fail(KvpoolConnectionError(reason))
        self._transport = None

    def _fail(self, error: KvpoolError) -> None:
        if self._lost is None:
            self._lost = error
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        pending, self._pending = self._pending, {}
        for p in pending.values():
            if not p.future.done():
                p.future.set_exception(error)

    def _sink_for(self, request_id: int, index: int, nbytes: int
                  ) -> memoryview | Segments | None:
        pending = self._pending.get(request_id)
        if pending is None:
            return None
        if index >= pending.count:
            raise BadFrameError(f"item {index + 1} in the reply to a request of "
                                f"{pending.count}")
        return pending.sinks[index] if pending.sinks is not None else None
