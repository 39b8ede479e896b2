"""A node that lies: a real TCP server on 127.0.0.1 whose replies a test rewrites.

:class:`LyingNode` parses each request frame as a node does, answers it as
:class:`tests.mock_nodes.MockNode` does (the replies ``server/data/handlers.py`` encodes),
then hands the reply's bytes to ``tamper(op, reply) -> bytes``, which may change any
byte of it: what a buggy, mismatched-version or compromised node sends. The clients
under test connect to it over real sockets, as they connect to a node.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from kvpool.placement.cluster_map import ClusterMap
from kvpool.protocol.errors import Status
from kvpool.protocol.frames import FRAME_HEADER_SIZE, Op, encode_error
from kvpool.protocol.parsers import RequestParser
from tests.mock_nodes import MockNode

__all__ = ["LyingNode", "Tamper", "hello_with", "set_header", "untouched"]

#: (op of the request, the honest reply's bytes) -> the bytes sent instead
Tamper = Callable[[Op, bytes], bytes]
# the frame header: magic, op, status, request id, count, epoch, body length
_HEADER = struct.Struct("<2sBBIIIQ")
_FIELDS = ("magic", "op", "status", "request_id", "count", "epoch", "body_len")


def untouched(_op: Op, reply: bytes) -> bytes:
    return reply


def set_header(reply: bytes, **fields: int) -> bytes:
    """``reply`` with header fields replaced (``count=``, ``body_len=``, ...)."""
    values = dict(zip(_FIELDS, _HEADER.unpack_from(reply), strict=True))
    values.update(fields)
    return _HEADER.pack(*(values[f] for f in _FIELDS)) + reply[FRAME_HEADER_SIZE:]


def hello_with(reply: bytes, **changes: Any) -> bytes:
    """A HELLO reply whose JSON has ``changes`` (a value of ``...`` removes the field)."""
    info = json.loads(reply[FRAME_HEADER_SIZE:])
    for name, value in changes.items():
        if value is ...:
            info.pop(name, None)
        else:
            info[name] = value
    body = json.dumps(info).encode()
    return set_header(reply[:FRAME_HEADER_SIZE], body_len=len(body)) + body


class LyingNode:
    """Serves until :meth:`close`; ``tamper`` may be replaced between calls."""

    def __init__(self, tamper: Tamper = untouched, *, cluster: bool = False,
                 close_after_lie: bool = False) -> None:
        self.tamper = tamper
        #: close the connection after a reply ``tamper`` changed (a fuzzer's lie then
        #: ends in an EOF, not in the client's deadline)
        self.close_after_lie = close_after_lie
        #: > 0: a reply over 64 KiB goes out in pieces (its first 1,000 bytes, then 40 KiB,
        #: then 300 KiB at a time) with this many seconds between them, as a slow link
        #: delivers it
        self.dribble = 0.0
        self.node = MockNode("liar")
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"kvpool://127.0.0.1:{self.port}"
        #: the one-node cluster map it serves (None: a standalone node)
        self.map = ClusterMap.from_dict({"epoch": 1, "nodes": [
            {"id": "liar", "data": f"127.0.0.1:{self.port}"}]}) if cluster else None
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        parser = RequestParser()
        try:
            while data := conn.recv(1 << 20):
                for request in parser.feed(data):
                    if request.header.op == Op.CLUSTER and self.map is None:
                        reply = encode_error(Op.CLUSTER, request.header.request_id,
                                             Status.UNKNOWN_OP, "a standalone node")
                    else:
                        reply = self.node.answer(request, self.map)
                    request.release()
                    if reply is None:
                        continue
                    honest = b"".join(reply)
                    with self._lock:  # one store for every connection
                        out = self.tamper(Op(request.header.op), honest)
                    self._send(conn, out)
                    if out != honest and self.close_after_lie:
                        return
                if parser.error is not None:
                    return
        except OSError:
            pass
        finally:
            conn.close()

    def _send(self, conn: socket.socket, out: bytes) -> None:
        if not self.dribble or len(out) <= 64 << 10:
            conn.sendall(out)
            return
        cuts = [0, 1000, 1000 + (40 << 10), *range(1000 + (340 << 10), len(out), 300 << 10)]
        for start, end in zip(cuts, [*cuts[1:], len(out)], strict=True):
            conn.sendall(out[start:end])
            time.sleep(self.dribble)

    def drop_connections(self) -> None:
        """Close every open connection (a client reconnects and says HELLO again)."""
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.drop_connections()
