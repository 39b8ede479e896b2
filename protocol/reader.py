"""Incremental, pure frame parsing: bytes in, frames out, no sockets.

:class:`StreamReader` drives a *plan*: a generator that yields what it needs
next (``Exact(n)`` bytes, ``Into(view)`` a caller buffer, ``Skip(n)``) and is
sent the bytes; ``Hold()`` stops it until the owner calls ``resume()`` (bytes that
arrive meanwhile wait in scratch), so the owner can act on a frame before the
next one is parsed. It implements the two halves of ``asyncio.BufferedProtocol``,
so a transport reads large values straight into their destination (a DRAM
arena slot on the node, the caller's buffer on the client) while headers go
through a small scratch buffer. ``feed(data)`` does the same for plain bytes,
which is how the tests split frames at every byte boundary.

A plan that raises leaves the reader dead; the owner closes the connection
and calls ``abort()`` so half-received reservations are released.

``whole=(need, parse)``: whenever the plan waits at that need (the plan's frame
header, asked for only at the start of a frame), the bytes in scratch are offered to
``parse(view)`` first, which returns how many it took: a frame that lies whole in
scratch (every small one) is parsed in one pass instead of a generator step per field;
0 leaves it to the plan.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

#: the ``whole`` hook of a StreamReader: a need, and a parser of a frame lying whole
#: in scratch (bytes taken, 0 for none)
WholeFrame = tuple["Need", Callable[[memoryview], int]]

__all__ = ["Exact", "Hold", "Into", "Need", "Plan", "Skip", "StreamReader"]


@dataclass(slots=True)
class Exact:
    """Send the plan exactly ``n`` bytes (as ``bytes`` or, if large, a ``bytearray``)."""

    n: int


@dataclass(slots=True)
class Into:
    """Fill ``view`` completely; ``on_fill`` sees each newly filled piece in order."""

    view: memoryview
    on_fill: Callable[[memoryview], object] | None = None


@dataclass(slots=True)
class Skip:
    """Discard ``n`` bytes."""

    n: int


@dataclass(slots=True)
class Hold:
    """Parse nothing more until the owner calls :meth:`StreamReader.resume`."""


Need = Exact | Into | Skip | Hold
Plan = Generator[Need, "bytes | bytearray | None", None]

# Exact needs above this size get their own buffer instead of the scratch.
_SMALL_EXACT = 4096
#: where a Skip's bytes are received with nothing in scratch ahead of them, up to its size
#: a receive (scratch holds 64 KiB: a 4 MiB value skipped took 64 receives). One for every
#: reader in the process: what lands in it is never read, so readers of other threads
#: writing into it at once change nothing.
_DISCARD = memoryview(bytearray(512 << 10))


class StreamReader:
    """Feeds a plan from a byte stream, copying only what goes through scratch."""

    __slots__ = ("_big", "_boundary", "_direct", "_end", "_filled", "_need", "_parse_whole",
                 "_plan", "_scratch", "_scratch_mv", "_start")

    def __init__(self, plan: Plan, scratch_size: int = 1 << 16,
                 whole: WholeFrame | None = None) -> None:
        if scratch_size < 2 * _SMALL_EXACT:
            raise ValueError("scratch_size too small")
        self._scratch = bytearray(scratch_size)
        self._scratch_mv = memoryview(self._scratch)
        self._start = 0
        self._end = 0
        self._filled = 0
        self._direct = False
        self._plan = plan
        self._big: bytearray | None = None
        self._boundary: Need | None = None
        self._parse_whole: Callable[[memoryview], int] | None = None
        if whole is not None:
            self._boundary, self._parse_whole = whole
        self._need: Need = next(plan)
        # plans start with a frame header: a small Exact that needs no normalising
        assert type(self._need) is Exact and 0 < self._need.n <= _SMALL_EXACT

    # -- BufferedProtocol half ------------------------------------------------------------

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        need = self._need
        if self._start == self._end:
            kind = type(need)
            if kind is Into:
                self._direct = True
                return need.view[self._filled :]  # type: ignore[union-attr]
            if kind is Skip:
                self._direct = True
                return _DISCARD[: need.n - self._filled]  # type: ignore[union-attr]
        self._direct = False
        if self._end == len(self._scratch):
            self._compact()
        return self._scratch_mv[self._end :]

    def more_of_value(self, nbytes: int) -> bool:
        """The short way for a receive straight into a value (``get_buffer`` handed out
        an :class:`Into` view) that does not fill it and has no ``on_fill``: counted,
        True; anything else False, and nothing done (call :meth:`buffer_updated`). A
        1 MiB PUT arrives in ~6 receives; all but the last take this way. (A receive
        into a :class:`Skip`'s discard buffer that does not end it, too.)"""
        if self._direct:
            need = self._need
            filled = self._filled + nbytes
            if type(need) is Skip:
                if filled < need.n:
                    self._filled = filled
                    return True
            elif need.on_fill is None and filled < len(need.view):  # type: ignore[union-attr]
                self._filled = filled
                return True
        return False

    @property
    def into_left(self) -> int:
        """Bytes the plan's :class:`Into` (or :class:`Skip`) need still waits for, with
        nothing in scratch ahead of them (0 otherwise): what is sure to come next on the
        stream."""
        need = self._need
        if self._start == self._end:
            kind = type(need)
            if kind is Into:
                return len(need.view) - self._filled  # type: ignore[union-attr]
            if kind is Skip:
                return need.n - self._filled  # type: ignore[union-attr]
        return 0

    def buffer_updated(self, nbytes: int) -> None:
        if self._direct:
            need = self._need
            start = self._filled
            self._filled += nbytes
            if type(need) is Skip:
                if self._filled == need.n:
                    self._advance(None)
            else:
                assert isinstance(need, Into)
                if need.on_fill is not None:
                    need.on_fill(need.view[start : self._filled])
                if self._filled == len(need.view):
                    self._advance(None)
        else:
            self._end += nbytes
        self._drain()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Push plain bytes through the same path a transport would."""
        src = memoryview(data).cast("B")
        pos = 0
        while pos < len(src):
            buf = self.get_buffer(len(src) - pos)
            n = min(len(buf), len(src) - pos)
            if not n:
                raise RuntimeError("fed past a Hold with the scratch full: resume() first")
            buf[:n] = src[pos : pos + n]
            pos += n
            self.buffer_updated(n)

    @property
    def holding(self) -> bool:
        """True while the plan waits at a :class:`Hold` for :meth:`resume`."""
        return type(self._need) is Hold

    def resume(self) -> None:
        """Go on past the plan's :class:`Hold`, parsing what arrived meanwhile."""
        if type(self._need) is not Hold:
            raise RuntimeError("resume() without a Hold")
        self._advance(None)
        self._drain()

    @property
    def buffered(self) -> int:
        """Bytes received but not yet consumed by the plan."""
        return self._end - self._start

    @property
    def at_boundary(self) -> bool:
        """Whether nothing is buffered and the plan waits for the ``whole`` hook's
        boundary need (a frame's first byte)."""
        return self._start == self._end and self._need is self._boundary is not None

    def close(self) -> None:
        self._plan.close()

    # -- internals ------------------------------------------------------------------------

    def _advance(self, value: bytes | bytearray | None) -> None:
        """Send the plan what it asked for; take its next non-empty need."""
        if self._big is not None:
            value, self._big = self._big, None
        self._filled = 0
        plan = self._plan
        need = plan.send(value)
        while True:  # type() checks: isinstance() is measurably slower per frame here
            kind = type(need)
            if kind is Exact:
                n = need.n  # type: ignore[union-attr]
                if n > _SMALL_EXACT:
                    self._big = bytearray(n)
                    need = Into(memoryview(self._big))
                elif n == 0:
                    need = plan.send(b"")
                    continue
            elif kind is Into:
                if not len(need.view):  # type: ignore[union-attr]
                    need = plan.send(None)
                    continue
            elif kind is Hold:
                pass
            elif need.n == 0:  # type: ignore[union-attr]
                need = plan.send(None)
                continue
            self._need = need
            return

    def _drain(self) -> None:
        mv = self._scratch_mv
        while self._start < self._end:
            need = self._need
            avail = self._end - self._start
            kind = type(need)
            if kind is Hold:
                break
            if need is self._boundary:
                assert self._parse_whole is not None
                taken = self._parse_whole(mv[self._start : self._end])
                if taken:
                    self._start += taken
                    continue
            if kind is Exact:
                n = need.n  # type: ignore[union-attr]
                if avail < n:
                    break
                start = self._start
                self._start = start + n
                self._advance(bytes(mv[start : start + n]))
            elif kind is Into:
                view = need.view  # type: ignore[union-attr]
                k = min(avail, len(view) - self._filled)
                piece = view[self._filled : self._filled + k]
                piece[:] = mv[self._start : self._start + k]
                self._start += k
                self._filled += k
                if need.on_fill is not None:  # type: ignore[union-attr]
                    need.on_fill(piece)  # type: ignore[union-attr]
                if self._filled == len(view):
                    self._advance(None)
            else:
                k = min(avail, need.n - self._filled)  # type: ignore[union-attr]
                self._start += k
                self._filled += k
                if self._filled == need.n:  # type: ignore[union-attr]
                    self._advance(None)
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._scratch):
            self._compact()

    def _compact(self) -> None:
        n = self._end - self._start
        self._scratch_mv[:n] = self._scratch_mv[self._start : self._end]
        self._start, self._end = 0, n
